// `moex serve` end to end, driven by the official `openai` npm client (pinned in package.json).
// usage: node serve_test.mjs MOEX_BINARY [MPIRUN]   (with MPIRUN: also `mpirun -np 2 moex serve --moe-parallel ep`)
// Generates a tiny model, starts servers on free ports of 127.0.0.1 and checks: completions and chat,
// streamed and not, with usage; greedy output equal to `moex generate`; bad clients (400 / 401 / 404 /
// 429); 200 concurrent streams of which half disconnect mid-stream, after which the KV-cache usage is 0 and
// the server still answers; prefix caching (cached tokens reported, same output as without the cache).
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';

const moex = process.argv[2];
const mpirun = process.argv[3];
assert.ok(moex, 'usage: node serve_test.mjs MOEX_BINARY');
const work = mkdtempSync(join(tmpdir(), 'moex-serve-test-'));
const model = join(work, 'tiny');
execFileSync(moex, ['gen-model', '--preset', 'tiny', '--seed', '7', '--out', model], { stdio: 'ignore' });

const servers = [];
function startServer(args, ranks = 1) {
  return new Promise((resolve, reject) => {
    const serve = ['serve', '--model', model, '--port', '0', '--threads', '1', ...args];
    const env = { ...process.env, OMPI_MCA_mpi_yield_when_idle: '1', OMPI_MCA_btl_vader_single_copy_mechanism: 'none' };
    const child = ranks === 1
      ? spawn(moex, serve, { stdio: ['ignore', 'pipe', 'inherit'] })
      : spawn(mpirun, ['--allow-run-as-root', '--oversubscribe', '-np', String(ranks), moex, ...serve],
              { stdio: ['ignore', 'pipe', 'inherit'], env });
    servers.push(child);
    let out = '';
    child.stdout.on('data', (d) => {
      out += d.toString();
      const m = out.match(/listening on (http:\/\/127\.0\.0\.1:(\d+))/);
      if (m) resolve({ child, url: m[1] });
    });
    child.on('exit', (code) => reject(new Error(`moex serve exited with ${code}: ${out}`)));
  });
}
function stopAll() {
  for (const s of servers) if (s.exitCode === null) s.kill('SIGTERM');
}
process.on('exit', () => { stopAll(); rmSync(work, { recursive: true, force: true }); });
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(1));  // ctest's timeout: no orphans

async function metrics(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const value = (name) => {
    const m = text.match(new RegExp(`^${name.replace(/[{}"]/g, (c) => '\\' + c)} (\\S+)$`, 'm'));
    assert.ok(m, `metric ${name} missing`);
    return Number(m[1]);
  };
  return { value, text };
}

let failures = 0;
async function check(name, fn) {
  try {
    await fn();
    console.log(`ok - ${name}`);
  } catch (e) {
    failures++;
    console.log(`not ok - ${name}\n${e.stack}`);
  }
}

const KEY = 'test-key';
// Cache: 64 blocks of 16 positions (4096 bytes each on the tiny model) = 1024 positions, below
// --max-model-len 2048, so "max_tokens beyond the cache" is its own case.
const main = await startServer(['--api-key', KEY, '--max-num-seqs', '16', '--max-batch-tokens', '256',
                                '--max-model-len', '2048', '--kv-cache-gb', '0.000262144']);
const client = new OpenAI({ baseURL: `${main.url}/v1`, apiKey: KEY, maxRetries: 0 });
const modelName = 'tiny';
const prompt = 'Once upon a time';

await check('GET /health and /v1/models', async () => {
  assert.equal((await fetch(`${main.url}/health`)).status, 200);
  const list = await client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), [modelName]);
  assert.equal(list.data[0].object, 'model');
});

let greedyText;
await check('completion, not streamed: usage and greedy output equal to moex generate', async () => {
  const r = await client.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0, ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 12);
  assert.ok(r.usage.prompt_tokens > 1);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  greedyText = r.choices[0].text;
  const out = execFileSync(moex, ['generate', '--model', model, '--prompt', prompt, '-n', '12', '--ignore-eos',
                                  '--kv-cache-dtype', 'bf16', '--threads', '1']).toString();
  const firstLine = out.slice(0, out.indexOf('\nload:'));
  assert.equal(prompt + greedyText, firstLine);
});

await check('completion, streamed: the chunks add up to the same text, then usage and [DONE]', async () => {
  const stream = await client.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0,
                                                   ignore_eos: true, stream: true,
                                                   stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, greedyText);
  assert.equal(finish, 'length');
  assert.ok(chunks >= 3, `only ${chunks} chunks`);
  assert.equal(usage.completion_tokens, 12);
});

await check('chat completion, streamed and not: same content, role, usage', async () => {
  const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Tell me a story.' }];
  const r = await client.chat.completions.create({ model: modelName, messages, max_tokens: 10, temperature: 0,
                                                   ignore_eos: true });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.usage.completion_tokens, 10);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 10);
  const stream = await client.chat.completions.create({ model: modelName, messages, max_tokens: 10, temperature: 0,
                                                        ignore_eos: true, stream: true,
                                                        stream_options: { include_usage: true } });
  let content = '', role = null, finish = null, usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) content += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(content, r.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.equal(usage.prompt_tokens, r.usage.prompt_tokens);  // (the second time its prefix may be cached)
  assert.equal(usage.completion_tokens, 10);
});

await check('sampling with a seed repeats; stop strings end the text before them', async () => {
  const a = await client.completions.create({ model: modelName, prompt, max_tokens: 16, temperature: 0.9, seed: 11 });
  const b = await client.completions.create({ model: modelName, prompt, max_tokens: 16, temperature: 0.9, seed: 11 });
  assert.equal(a.choices[0].text, b.choices[0].text);
  const stop = greedyText.slice(3, 5);
  const s = await client.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0,
                                             ignore_eos: true, stop: [stop] });
  assert.equal(s.choices[0].text, greedyText.slice(0, greedyText.indexOf(stop)));
  assert.equal(s.choices[0].finish_reason, 'stop');
});

async function expectStatus(status, promise, what) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, status, `${what}: ${e.message}`);
    assert.ok(e.error && typeof e.error.message === 'string', `${what}: no OpenAI error object`);
    return e;
  }
  assert.fail(`${what}: accepted`);
}

await check('bad requests: 400 with an OpenAI error object, 404 for another model', async () => {
  const raw = await fetch(`${main.url}/v1/completions`, { method: 'POST', headers: { Authorization: `Bearer ${KEY}` },
                                                         body: '{"prompt": "x", "max_tokens": ' });
  assert.equal(raw.status, 400);
  const body = await raw.json();
  assert.equal(body.error.type, 'invalid_request_error');
  await expectStatus(400, client.completions.create({ model: modelName, prompt, max_tokens: 'many' }), 'wrong type');
  await expectStatus(400, client.completions.create({ model: modelName, prompt, temperature: -1 }), 'out of range');
  await expectStatus(400, client.completions.create({ model: modelName, prompt, bogus_field: 1 }), 'unknown field');
  await expectStatus(400, client.chat.completions.create({ model: modelName, messages: 'hi' }), 'messages not an array');
  const long = Array.from({ length: 2100 }, (_, i) => 3 + (i % 400));
  const e = await expectStatus(400, client.completions.create({ model: modelName, prompt: long, max_tokens: 4 }),
                               'prompt longer than --max-model-len');
  assert.match(e.error.message, /maximum context length is 2048/);
  const c = await expectStatus(400, client.completions.create({ model: modelName, prompt, max_tokens: 1500 }),
                               'max_tokens beyond the cache');
  assert.match(c.error.message, /KV cache/);
  await expectStatus(404, client.completions.create({ model: 'gpt-4', prompt }), 'unknown model');
  const big = await fetch(`${main.url}/v1/completions`, { method: 'POST', headers: { Authorization: `Bearer ${KEY}` },
                                                         body: '['.repeat(100000) });
  assert.equal(big.status, 400);
});

await check('API key: wrong or missing -> 401', async () => {
  const wrong = new OpenAI({ baseURL: `${main.url}/v1`, apiKey: 'nope', maxRetries: 0 });
  await expectStatus(401, wrong.completions.create({ model: modelName, prompt }), 'wrong key');
  const missing = await fetch(`${main.url}/v1/models`);
  assert.equal(missing.status, 401);
  assert.ok((await missing.json()).error.message);
  assert.equal((await fetch(`${main.url}/health`)).status, 200);  // health needs no key
});

await check('200 concurrent streams, half disconnect mid-stream: KV usage back to 0, server still answers', async () => {
  let seed = 12345;
  const random = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
  const jobs = [];
  let completed = 0, aborted = 0;
  for (let i = 0; i < 200; i++) {
    const disconnect = random() < 0.5;
    jobs.push((async () => {
      const controller = new AbortController();
      const stream = await client.completions.create(
        { model: modelName, prompt: `Request ${i} says`, max_tokens: disconnect ? 1000 : 24, temperature: 0.7, seed: i,
          ignore_eos: true, stream: true }, { signal: controller.signal });
      let chunks = 0, finish = null;
      try {
        for await (const chunk of stream) {
          chunks++;
          if (chunk.choices[0]?.finish_reason) finish = chunk.choices[0].finish_reason;
          if (disconnect && chunks === 2) controller.abort();
        }
      } catch (e) {
        if (!disconnect) throw e;
        aborted++;
        return;
      }
      if (disconnect && finish === null) { aborted++; return; }
      assert.equal(finish, 'length', `request ${i}`);
      completed++;
    })());
  }
  await Promise.all(jobs);
  assert.ok(completed >= 60 && aborted >= 60, `completed ${completed}, aborted ${aborted}`);
  let usage = 1, running = 1, waiting = 1;
  for (let t = 0; t < 100 && (usage !== 0 || running !== 0 || waiting !== 0); t++) {
    await new Promise((r) => setTimeout(r, 100));
    const m = await metrics(main.url);
    usage = m.value('moex:kv_cache_usage_perc');
    running = m.value('moex:num_requests_running');
    waiting = m.value('moex:num_requests_waiting');
  }
  assert.equal(usage, 0, 'KV cache usage after the storm');
  assert.equal(running, 0);
  assert.equal(waiting, 0);
  const m = await metrics(main.url);
  assert.ok(m.value('moex:request_success_total{finished_reason="abort"}') >= aborted / 2,
            `disconnected requests were not cancelled: ${m.value('moex:request_success_total{finished_reason="abort"}')} of ${aborted} (${m.value('moex:request_success_total{finished_reason="length"}')} length)`);
  const r = await client.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0, ignore_eos: true });
  assert.equal(r.choices[0].text, greedyText);
});

// A second server: one sequence at a time, no queue, no prefix caching.
const small = await startServer(['--max-num-seqs', '1', '--max-waiting', '0', '--max-batch-tokens', '64',
                                 '--no-prefix-caching']);
const smallClient = new OpenAI({ baseURL: `${small.url}/v1`, apiKey: 'unused', maxRetries: 0 });

await check('prefix caching: a shared 200-token prefix is reported cached, with the same output', async () => {
  const prefix = Array.from({ length: 200 }, (_, i) => 3 + ((i * 37) % 480));
  const a = [...prefix, 11, 12, 13, 14, 15];
  const b = [...prefix, 21, 22, 23, 24, 25, 26, 27];
  const before = (await metrics(main.url)).value('moex:prefix_cache_hits_total');
  const ra = await client.completions.create({ model: modelName, prompt: a, max_tokens: 8, temperature: 0, ignore_eos: true });
  assert.equal(ra.usage.prompt_tokens_details.cached_tokens, 0);
  const rb = await client.completions.create({ model: modelName, prompt: b, max_tokens: 8, temperature: 0, ignore_eos: true });
  assert.equal(rb.usage.prompt_tokens_details.cached_tokens, 192);  // 12 full blocks of 16 within the prefix
  const after = (await metrics(main.url)).value('moex:prefix_cache_hits_total');
  assert.equal(after - before, 192);
  const uncached = await smallClient.completions.create({ model: modelName, prompt: b, max_tokens: 8, temperature: 0,
                                                          ignore_eos: true });
  assert.equal(uncached.usage.prompt_tokens_details.cached_tokens, 0);
  assert.equal(rb.choices[0].text, uncached.choices[0].text);
});

await check('queue full -> 429', async () => {
  const results = await Promise.allSettled(Array.from({ length: 4 }, () =>
    smallClient.completions.create({ model: modelName, prompt, max_tokens: 300, temperature: 0, ignore_eos: true })));
  const statuses = results.map((r) => (r.status === 'fulfilled' ? 200 : r.reason.status));
  assert.ok(statuses.includes(200), statuses.join(','));
  assert.ok(statuses.includes(429), statuses.join(','));
  for (const s of statuses) assert.ok(s === 200 || s === 429, statuses.join(','));
  assert.ok((await metrics(small.url)).value('moex:requests_rejected_total') >= 1);
});

await check('bad start-up flags: one error line, exit 2', async () => {
  const port = new URL(main.url).port;
  for (const args of [['--max-num-seqs', '8', '--max-batch-tokens', '4'], ['--port', port], ['--kv-cache-gb', '1e-9'],
                      ['--max-model-len', '999999'], ['--kv-cache-dtype', 'f16']]) {
    let status = 0, stderr = '';
    try {
      execFileSync(moex, ['serve', '--model', model, '--threads', '1', ...args],
                   { stdio: ['ignore', 'pipe', 'pipe'], timeout: 20000 });
    } catch (e) {
      status = e.status;
      stderr = e.stderr.toString();
    }
    assert.equal(status, 2, `${args.join(' ')}: exit ${status} ${stderr}`);
    assert.match(stderr, /^moex: error: [^\n]+\n$/, `${args.join(' ')}: ${stderr}`);
  }
});

if (mpirun) {
  await check('mpirun -np 2 moex serve --moe-parallel ep answers the tokens of one rank', async () => {
    const ep = await startServer(['--moe-parallel', 'ep', '--comm-tuning', 'none', '--max-num-seqs', '8',
                                  '--max-batch-tokens', '64'], 2);
    const epClient = new OpenAI({ baseURL: `${ep.url}/v1`, apiKey: 'unused', maxRetries: 0 });
    const r = await epClient.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0, ignore_eos: true });
    assert.equal(r.choices[0].text, greedyText);
    // A few concurrent ones, streamed: the same text as each alone on one rank.
    const prompts = ['A', 'Two words', 'Three short words', 'And a fourth prompt here'];
    const one = await Promise.all(prompts.map((p) =>
      client.completions.create({ model: modelName, prompt: p, max_tokens: 10, temperature: 0, ignore_eos: true })));
    const two = await Promise.all(prompts.map(async (p) => {
      let text = '';
      const stream = await epClient.completions.create({ model: modelName, prompt: p, max_tokens: 10, temperature: 0,
                                                         ignore_eos: true, stream: true });
      for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
      return text;
    }));
    assert.deepEqual(two, one.map((x) => x.choices[0].text));
    ep.child.kill('SIGTERM');
  });
}

stopAll();
console.log(failures ? `${failures} check(s) failed` : 'all checks passed');
process.exit(failures ? 1 : 0);
