// `moex serve --batch-invariant` against `moex generate --batch-invariant`, through the official `openai`
// npm client (pinned in package.json). usage: node batch_invariant_test.mjs MOEX_BINARY
// 8 concurrent greedy completions with prompts of different lengths (the server batches their prefill chunks
// and decode rows together) must give exactly the text `moex generate` gives each prompt alone. The model is
// tiny with experts of intermediate 2560 and int8 weights: w2's K spans several K blocks, so without the flag
// the weight-only kernel's loop depends on how many rows an expert got in the step (tests/unit has the
// bit-level proof that the two loops differ).
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';

const moex = process.argv[2];
assert.ok(moex, 'usage: node batch_invariant_test.mjs MOEX_BINARY');
const work = mkdtempSync(join(tmpdir(), 'moex-batch-invariant-'));
const model = join(work, 'tiny2560');
execFileSync(moex, ['gen-model', '--preset', 'tiny', '--intermediate', '2560', '--seed', '11', '--out', model],
             { stdio: 'ignore' });
const modelFlags = ['--weights', 'int8', '--kv-cache-dtype', 'bf16', '--batch-invariant'];
// The server splits each step over 2 threads, generate runs on 1: the numbers depend on neither.

let server = null;
process.on('exit', () => {
  if (server && server.exitCode === null) server.kill('SIGTERM');
  rmSync(work, { recursive: true, force: true });
});
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(1));  // ctest's timeout: no orphans

const url = await new Promise((resolve, reject) => {
  server = spawn(moex, ['serve', '--model', model, '--port', '0', '--max-num-seqs', '8', '--max-batch-tokens', '256',
                        '--max-model-len', '512', '--threads', '2', ...modelFlags], { stdio: ['ignore', 'pipe', 'inherit'] });
  let out = '';
  server.stdout.on('data', (d) => {
    out += d.toString();
    const m = out.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
    if (m) resolve(m[1]);
  });
  server.on('exit', (code) => reject(new Error(`moex serve exited with ${code}: ${out}`)));
});
const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0 });

// Prompts of 1 to ~60 words (a few to ~100 tokens).
const words = 'the quick brown fox jumps over a lazy dog while old kings dream of bright new cities'.split(' ');
const prompts = [1, 3, 7, 12, 20, 28, 41, 60].map((n, i) =>
  Array.from({ length: n }, (_, j) => words[(j * 5 + i * 3) % words.length]).join(' '));
const maxTokens = 16;

// The served tokens' ids: with `logprobs: 0` and vLLM's `return_tokens_as_token_ids`, every token is named
// "token_id:N" in `logprobs.tokens`.
const request = (prompt) => client.completions.create({ prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true,
                                                        logprobs: 0, return_tokens_as_token_ids: true });
const idsOf = (r) => r.choices[0].logprobs.tokens.map((t) => {
  assert.match(t, /^token_id:\d+$/);
  return Number(t.slice('token_id:'.length));
});
const served = await Promise.all(prompts.map(request));  // 8 at once: batched prefill chunks and decode rows
const alone = [];
for (const prompt of prompts) alone.push(await request(prompt));  // one at a time on the same server
let failures = 0;
const fail = (msg) => { failures++; console.log(`not ok - ${msg}`); };
for (let i = 0; i < prompts.length; ++i) {
  const r = served[i], a = alone[i];
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, maxTokens);
  assert.equal(r.choices[0].logprobs.tokens.length, maxTokens);
  const what = `prompt ${i} (${r.usage.prompt_tokens} tokens)`;
  if (JSON.stringify(r.choices[0].logprobs.tokens) !== JSON.stringify(a.choices[0].logprobs.tokens) ||
      r.choices[0].text !== a.choices[0].text) {
    fail(`${what}: served among 8 differs from served alone\n  batched: ${JSON.stringify(r.choices[0].logprobs.tokens)}` +
         `\n  alone:   ${JSON.stringify(a.choices[0].logprobs.tokens)}`);
    continue;
  }
  // moex generate alone, --print-ids: its line "ids: ..." are the new tokens' ids.
  const out = execFileSync(moex, ['generate', '--model', model, '--prompt', prompts[i], '-n', String(maxTokens),
                                  '--ignore-eos', '--print-ids', '--threads', '1', ...modelFlags]).toString();
  const line = out.split('\n').find((l) => l.startsWith('ids:'));
  assert.ok(line, `moex generate --print-ids printed no ids line: ${out}`);
  const gen = line.slice('ids:'.length).trim().split(/\s+/).map(Number);
  if (JSON.stringify(gen) !== JSON.stringify(idsOf(r))) {
    fail(`${what}: served ids differ from moex generate alone\n  served:   ${idsOf(r)}\n  generate: ${gen}`);
    continue;
  }
  console.log(`ok - ${what}: among 8 = alone (ids and text) = moex generate alone (${gen.length} ids)`);
}
if (failures) {
  console.log(`${failures} of ${prompts.length} prompts differ`);
  process.exit(1);
}
console.log(`all ${prompts.length} concurrent greedy completions equal each alone (served, and moex generate)`);
process.exit(0);
