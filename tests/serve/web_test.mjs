// The web page and /v1/engine/stats over plain HTTP (usage: node web_test.mjs MOEX_BINARY); the page in a real
// browser is web_browser_test.mjs.
// - GET / is the page (text/html, no key needed, no URL to anywhere else, a Content-Security-Policy that allows
//   only this server); --no-web makes it a 404;
// - /v1/engine/stats needs the key like the API, and its counters agree with what was asked of the server and
//   with each other: every computed row routed to k experts in every MoE layer, zones within the steps' time.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { check, finish, startServer as start, stopServer, workFolder } from './harness.mjs';

const moex = process.argv[2];
assert.ok(moex, 'usage: node web_test.mjs MOEX_BINARY');
const model = join(workFolder('moex-web-test-'), 'tiny');
execFileSync(moex, ['gen-model', '--preset', 'tiny', '--seed', '7', '--out', model], { stdio: 'ignore' });
const startServer = (args) => start(moex, model, args);
const KEY = 'web-test-key';
const auth = { Authorization: `Bearer ${KEY}` };

const server = await startServer(['--api-key', KEY, '--max-num-seqs', '4', '--max-batch-tokens', '64']);

await check('GET / is the page, open without the key, self-contained, with a CSP of this server only', async () => {
  assert.match(server.access, /all but \/, \/health and \/metrics/);
  assert.match(server.banner, /web page \(chat, engine charts\) at http:\/\/127\.0\.0\.1:\d+\//);
  const r = await fetch(`${server.url}/`);
  assert.equal(r.status, 200);
  assert.equal(r.headers.get('content-type'), 'text/html; charset=utf-8');
  const csp = r.headers.get('content-security-policy');
  assert.match(csp, /default-src 'none'/);
  assert.match(csp, /connect-src 'self'/);
  const html = await r.text();
  assert.match(html, /^<!DOCTYPE html>/);
  assert.ok(html.length > 5000 && html.length < 200000, `${html.length} bytes`);
  // Nothing fetched from elsewhere: no absolute URL at all, and no src/href but the inline icon.
  assert.deepEqual(html.match(/(https?:)?\/\/[\w.-]+\.[a-z]{2,}/gi) ?? [], []);
  assert.deepEqual([...html.matchAll(/\b(?:src|href)\s*=\s*"([^"]*)"/g)].map((m) => m[1]), ['data:,']);
  for (const path of ['/v1/models', '/v1/chat/completions', '/v1/engine/stats']) assert.ok(html.includes(`'${path}'`), path);
  // The page's own requests send the key; everything else of the API still needs it.
  assert.equal((await fetch(`${server.url}/v1/models`)).status, 401);
  assert.equal((await fetch(`${server.url}/index.html`)).status, 401);
});

await check('/v1/engine/stats needs the key and reports the work done', async () => {
  const unauthorized = await fetch(`${server.url}/v1/engine/stats`);
  assert.equal(unauthorized.status, 401);
  const before = await (await fetch(`${server.url}/v1/engine/stats`, { headers: auth })).json();
  assert.equal(before.steps.count, 0);
  const body = { prompt: 'Once upon a time there was a', max_tokens: 12, temperature: 0, ignore_eos: true };
  const answers = await Promise.all([0, 1, 2].map(() => fetch(`${server.url}/v1/completions`, {
    method: 'POST', headers: { ...auth, 'Content-Type': 'application/json' }, body: JSON.stringify(body) })
    .then((r) => r.json())));
  const generated = answers.reduce((n, a) => n + a.usage.completion_tokens, 0);
  const prompt = answers.reduce((n, a) => n + a.usage.prompt_tokens, 0);
  assert.equal(generated, 36);
  const r = await fetch(`${server.url}/v1/engine/stats`, { headers: auth });
  assert.equal(r.status, 200);
  assert.equal(r.headers.get('content-type'), 'application/json');
  const s = await r.json();
  const config = JSON.parse(execFileSync('cat', [join(model, 'config.json')]).toString());
  assert.equal(s.config.layers, config.num_hidden_layers);
  assert.equal(s.config.experts, config.num_local_experts);
  assert.equal(s.config.experts_per_token, config.num_experts_per_tok);
  assert.equal(s.tokens.generated, generated);
  assert.equal(s.tokens.prompt, prompt);
  assert.equal(s.requests.finished_length, 3);
  assert.equal(s.requests.running, 0);
  assert.equal(s.kv_blocks.used + s.kv_blocks.cached + s.kv_blocks.free, s.kv_blocks.total);
  assert.equal(s.kv_blocks.used, 0);  // nothing running: every block freed, the prompts' kept as cache
  assert.ok(s.kv_blocks.cached > 0);
  // Rows: each request's prompt minus its cached prefix, plus one decode row per token after the first.
  assert.ok(s.steps.count > 0 && s.steps.count <= s.steps.prompt_rows + s.steps.decode_rows);
  assert.equal(s.steps.decode_rows, generated - 3);
  assert.equal(s.steps.prompt_rows, prompt - s.tokens.prefix_cache_hits);
  // Dropless routing: every computed row goes to k experts in each MoE layer (zero elsewhere).
  const rows = s.steps.prompt_rows + s.steps.decode_rows;
  assert.equal(s.expert_tokens.length, s.config.layers);
  s.expert_tokens.forEach((row, l) => {
    const sum = row.reduce((a, b) => a + b, 0);
    assert.equal(sum, s.config.moe_layers[l] ? rows * s.config.experts_per_token : 0, `layer ${l}: ${row}`);
  });
  // Zones: attention, router and experts timed; the zones plus "other" are the steps' time.
  for (const z of ['attention', 'router', 'experts', 'lm_head', 'embedding']) assert.ok(s.zone_seconds[z] > 0, z);
  const zoned = Object.values(s.zone_seconds).reduce((a, b) => a + b, 0);
  assert.ok(Math.abs(zoned - s.steps.seconds) < 1e-6 + 1e-9 * rows, `${zoned} vs ${s.steps.seconds}`);
  assert.ok(s.steps.forward_seconds <= s.steps.seconds);
  assert.ok(s.last_step.sequences >= 1 && s.last_step.ms > 0);
});

await stopServer(server);

await check('--no-web: GET / is a 404, the stats are still served', async () => {
  const s = await startServer(['--no-web', '--max-num-seqs', '1', '--max-batch-tokens', '64']);
  assert.doesNotMatch(s.banner, /web page/);
  const r = await fetch(`${s.url}/`);
  assert.equal(r.status, 404);
  assert.match(r.headers.get('content-type'), /application\/json/);
  assert.equal((await fetch(`${s.url}/v1/engine/stats`)).status, 200);
  await stopServer(s);
  const keyed = await startServer(['--no-web', '--api-key', KEY, '--max-num-seqs', '1', '--max-batch-tokens', '64']);
  assert.match(keyed.access, /all but \/health and \/metrics/);
  assert.equal((await fetch(`${keyed.url}/`)).status, 401);  // not open any more: an unknown path like the rest
  assert.equal((await fetch(`${keyed.url}/`, { headers: auth })).status, 404);
  await stopServer(keyed);
});

finish('web checks');
