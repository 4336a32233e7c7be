"""Parses Prometheus text exposition with the official client's parser (Debian python3-prometheus-client),
for tests/unit/metrics_test.cc. stdin: the exposition; stdout: JSON
{"families": [{"name", "type", "help"}], "samples": [{"name", "labels", "value"}]}. A parse error exits 1."""
import json
import math
import sys

from prometheus_client.parser import text_string_to_metric_families


def main():
    families, samples = [], []
    for family in text_string_to_metric_families(sys.stdin.read()):
        families.append({"name": family.name, "type": family.type, "help": family.documentation})
        for s in family.samples:
            value = s.value
            samples.append({"name": s.name, "labels": dict(s.labels),
                            "value": "+Inf" if math.isinf(value) else value})
    json.dump({"families": families, "samples": samples}, sys.stdout)


if __name__ == "__main__":
    main()
