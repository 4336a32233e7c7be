// `moex serve` on every model family and file form, driven by the official `openai` npm client.
// usage: node serve_families.mjs MOEX_BINARY
// Models: gen-model's tiny (Mixtral: tokenizer.json + tokenizer.model), the same folder with only
// tokenizer.json, qwen2-moe-tiny, qwen3-moe-tiny, olmoe-tiny and dots1-tiny (byte-level tokenizer.json),
// and `moex convert`'s f32 GGUF of tiny (SentencePiece vocabulary) and of qwen3-moe-tiny (gpt2 vocabulary).
// For each, a server on a free port of 127.0.0.1: the served name; a greedy completion, not streamed, whose
// token ids and text equal `moex generate --print-ids` on the same model and prompt (generate's text is
// checked against HF tokenizers and SentencePiece by the tokenizer tests; on tiny the continuation of
// "hello" holds byte pieces that are not UTF-8 as a run); the same streamed; chat, streamed and not, equal
// to a completion of the prompt the family's template renders, written out here as HF's template renders
// it (ChatML, Mixtral's [INST]); a model without a template answers chat with a 400. A GGUF gives the text
// of the folder it was converted from.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { cpSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import OpenAI from 'openai';
import { check, finish, startServer as start, stopServer, workFolder } from './harness.mjs';

const moex = process.argv[2];
assert.ok(moex, 'usage: node serve_families.mjs MOEX_BINARY');
const work = workFolder('moex-serve-families-');

const run = (args) => execFileSync(moex, args, { stdio: ['ignore', 'pipe', 'inherit'] }).toString();
const path = (name) => join(work, name);
for (const preset of ['tiny', 'qwen2-moe-tiny', 'qwen3-moe-tiny', 'olmoe-tiny', 'dots1-tiny'])
  run(['gen-model', '--preset', preset, '--seed', '7', '--out', path(preset)]);
cpSync(path('tiny'), path('tiny-json'), { recursive: true });
rmSync(path('tiny-json/tokenizer.model'));
for (const src of ['tiny', 'qwen3-moe-tiny'])
  run(['convert', '--model', path(src), '--out', path(`${src}.gguf`), '--type', 'f32']);

// The prompt a chat template renders for one user message with the generation prompt, as HF's does; the
// server adds the BOS of a completion prompt itself.
const rendered = {
  chatml: (content) => `<|im_start|>user\n${content}<|im_end|>\n<|im_start|>assistant\n`,
  mixtral: (content) => ` [INST] ${content} [/INST]`,
};
const models = [
  { name: 'tiny', chat: 'mixtral', prompt: 'hello' },
  { name: 'tiny-json', chat: 'mixtral', prompt: 'hello', same: 'tiny' },
  { name: 'qwen2-moe-tiny', chat: 'chatml' },
  { name: 'qwen3-moe-tiny', chat: 'chatml' },
  { name: 'olmoe-tiny', chat: null },
  { name: 'dots1-tiny', chat: 'chatml' },
  { name: 'tiny.gguf', chat: 'mixtral', prompt: 'hello', same: 'tiny' },
  { name: 'qwen3-moe-tiny.gguf', chat: 'chatml', same: 'qwen3-moe-tiny' },
];

const startServer = (model) => start(moex, model, ['--max-num-seqs', '4', '--max-model-len', '256']);

// SIGTERM now; the exits (code 0) are checked at the end.
const stopped = [];

// `moex generate` greedy with the server's KV cache type: the new ids and the text after the prompt.
function generate(model, prompt, n) {
  const out = run(['generate', '--model', model, '--prompt', prompt, '-n', String(n), '--ignore-eos', '--print-ids',
                   '--kv-cache-dtype', 'bf16', '--threads', '1']);
  const m = out.match(/^([\s\S]*)\nids:((?: \d+)*)\nload:/);
  assert.ok(m, `cannot read moex generate's output: ${JSON.stringify(out)}`);
  assert.ok(m[1].startsWith(prompt), `generate printed ${JSON.stringify(m[1])}`);
  return { ids: m[2].trim().split(' ').map(Number), text: m[1].slice(prompt.length) };
}

async function streamText(stream, piece) {
  let text = '', finish = null, role = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += piece(c) ?? '';
      if (c.delta?.role) role = c.delta.role;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, role };
}

const texts = {};
for (const m of models) {
  const model = path(m.name);
  const prompt = m.prompt ?? 'Once upon a time';
  let want;
  await check(m.name, async () => {
    const server = await startServer(model);
    try {
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
      assert.match(server.banner, new RegExp(`chat template ${m.chat ?? 'none'};`));
      assert.deepEqual((await client.models.list()).data.map((x) => x.id), [m.name]);

      const n = 8;
      want = generate(model, prompt, n);
      const r = await client.completions.create({ model: m.name, prompt, max_tokens: n, temperature: 0, ignore_eos: true,
                                                 logprobs: 0, return_tokens_as_token_ids: true });
      const ids = r.choices[0].logprobs.tokens.map((t) => Number(t.replace(/^token_id:/, '')));
      assert.deepEqual(ids, want.ids, 'completion ids vs moex generate');
      assert.equal(r.choices[0].text, want.text, 'completion text vs moex generate');
      assert.equal(r.choices[0].finish_reason, 'length');
      texts[m.name] = r.choices[0].text;
      if (m.same) assert.equal(texts[m.name], texts[m.same], `${m.name} vs ${m.same}`);
      const s = await streamText(await client.completions.create({ model: m.name, prompt, max_tokens: n, temperature: 0,
                                                                   ignore_eos: true, stream: true }), (c) => c.text);
      assert.equal(s.text, want.text, 'streamed completion');
      assert.equal(s.finish, 'length');

      const content = 'Tell me a story.';
      const messages = [{ role: 'user', content }];
      if (m.chat) {
        const c = await client.chat.completions.create({ model: m.name, messages, max_tokens: 6, temperature: 0,
                                                         ignore_eos: true });
        const plain = await client.completions.create({ model: m.name, prompt: rendered[m.chat](content), max_tokens: 6,
                                                        temperature: 0, ignore_eos: true });
        assert.equal(c.choices[0].message.role, 'assistant');
        assert.equal(c.choices[0].message.content, plain.choices[0].text, 'chat vs the rendered prompt as a completion');
        assert.equal(c.usage.prompt_tokens, plain.usage.prompt_tokens);
        const cs = await streamText(await client.chat.completions.create({ model: m.name, messages, max_tokens: 6,
                                                                           temperature: 0, ignore_eos: true, stream: true }),
                                    (x) => x.delta.content);
        assert.equal(cs.text, c.choices[0].message.content, 'streamed chat');
        assert.equal(cs.role, 'assistant');
        assert.equal(cs.finish, 'length');
      } else {
        await assert.rejects(client.chat.completions.create({ model: m.name, messages, max_tokens: 4 }),
                             (e) => e.status === 400, 'chat without a template: 400');
      }
    } finally {
      stopped.push(stopServer(server));
    }
  });
  if (want) console.log(`# ${m.name}: ${JSON.stringify(want.text)} (ids ${want.ids.join(' ')})`);
}
await check('every server exits 0 on SIGTERM', async () => {
  for (const [i, exit] of (await Promise.all(stopped)).entries())
    assert.deepEqual(exit, { code: 0, signal: null }, `server ${i}`);
});
finish(`checks of ${models.length} models`);
