// llama.cpp (node-llama-cpp's prebuilt CPU build, never built or downloaded here) as the independent
// reader of a GGUF file: prints JSON with, for each position of --ids, llama.cpp's next-token probability of
// every vocabulary entry (temperature 1, no truncation), and llama.cpp's tokenization of each --text.
// Usage: node llama_eval.mjs MODEL.gguf --ids 1,2,3 [--text T]...
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const args = process.argv.slice(2);
const modelPath = args[0];
let ids = [];
const texts = [];
for (let i = 1; i < args.length; i += 2) {
  if (args[i] === "--ids") ids = args[i + 1].split(",").map(Number);
  else if (args[i] === "--text") texts.push(args[i + 1]);
  else throw new Error(`unknown argument ${args[i]}`);
}
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, useMmap: true});
const out = {vocab: model.tokens ? undefined : undefined, positions: [], tokenized: []};
if (ids.length > 0) {
  const context = await model.createContext({contextSize: Math.max(64, ids.length + 8), batchSize: 512, threads: 1});
  const sequence = context.getSequence();
  const items = ids.map((id) => [id, {generateNext: {probabilities: true, options: {temperature: 1, topK: 0, topP: 1, minP: 0}}}]);
  const results = await sequence.controlledEvaluate(items);
  for (const r of results) out.positions.push([...r.next.probabilities.entries()]);
  await context.dispose();
}
for (const text of texts) out.tokenized.push(Array.from(model.tokenize(text)));
process.stdout.write(JSON.stringify(out) + "\n");
await model.dispose();
await llama.dispose();
