// `moex serve` against careless and hostile clients, through raw sockets where no HTTP client would send the
// bytes (usage: node hostile_test.mjs MOEX_BINARY). Each check bounds its own time and the server's memory:
// - an unauthenticated body is refused after its head (chunked or not), a chunked body over the limit is a 413;
// - a prompt longer in bytes than the context can hold is refused before it is tokenized, with bounded memory;
// - pipelined requests are answered in order; bad Content-Length values are a 400 at once;
// - /health and /metrics without a key, and --metrics-require-key; `--api-key ""` is a start-up error;
// - a burst of 300 requests against --max-num-seqs 4 --max-waiting 4 gets only 200s and 429s;
// - SIGTERM right after start-up stops the server (cpp-httplib ignores a stop before it listens).
import assert from 'node:assert/strict';
import { spawnSync, execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { connect } from 'node:net';
import { join } from 'node:path';
import { check, finish, startServer as start, stopServer, workFolder } from './harness.mjs';

const moex = process.argv[2];
assert.ok(moex, 'usage: node hostile_test.mjs MOEX_BINARY');
const model = join(workFolder('moex-hostile-test-'), 'tiny');
execFileSync(moex, ['gen-model', '--preset', 'tiny', '--seed', '7', '--out', model], { stdio: 'ignore' });
const startServer = (args) => start(moex, model, args);

// The server's resident memory in MB (its pid's VmRSS). Under AddressSanitizer (CI's second run) freed memory
// waits in ASan's quarantine and malloc's options do not apply: the memory bounds are checked only without it.
const rssMB = (child) => Number(readFileSync(`/proc/${child.pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)[1]) / 1024;
const sanitized = (child) => readFileSync(`/proc/${child.pid}/maps`, 'utf8').includes('libasan');
const assertRss = (child, base, bound) => {
  if (!sanitized(child)) assert.ok(rssMB(child) < base + bound, `RSS ${base.toFixed(0)} -> ${rssMB(child).toFixed(0)} MB`);
};

// Opens a raw connection, writes `head`, then calls `feed(sock)` (which may keep writing until it returns
// false); resolves with everything received, whether the server closed the connection, how many bytes were
// written, and the milliseconds to the first response byte. Gives up after `timeoutMs`.
function raw(port, head, { feed = null, timeoutMs = 10000, endOnReply = false, until = null } = {}) {
  return new Promise((resolve) => {
    const sock = connect(port, '127.0.0.1');
    const start = Date.now();
    let got = '', firstByte = -1, written = 0, done = false;
    const finish = (closed) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      sock.destroy();
      resolve({ got, closed, written, firstByte });
    };
    const timer = setTimeout(() => finish(false), timeoutMs);
    sock.on('data', (d) => {
      if (firstByte < 0) firstByte = Date.now() - start;
      got += d.toString('latin1');
      if (endOnReply && /\r\n\r\n/.test(got)) setTimeout(() => finish(false), 200);
      if (until && until(got)) finish(false);
    });
    sock.on('error', () => {});
    sock.on('close', () => finish(true));
    sock.write(head);
    written += Buffer.byteLength(head);
    if (!feed) return;
    const pump = () => {
      while (!done && !sock.destroyed) {
        const data = feed();
        if (data === null) return;
        written += data.length;
        if (!sock.write(data)) return sock.once('drain', pump);
      }
    };
    pump();
  });
}
const statusOf = (got) => [...got.matchAll(/HTTP\/1\.1 (\d{3})/g)].map((m) => Number(m[1]));

const KEY = 'hostile-key';
const auth = { Authorization: `Bearer ${KEY}` };
const main = await startServer(['--api-key', KEY, '--max-num-seqs', '4', '--max-waiting', '4', '--max-batch-tokens', '64',
                                '--max-model-len', '256']);
const baseRss = rssMB(main.child);

await check('start-up line says the key is required; `--api-key ""` and a key with spaces are start-up errors', async () => {
  assert.match(main.access, /API key required/);
  for (const key of ['', 'two words']) {
    const r = spawnSync(moex, ['serve', '--model', model, '--port', '0', '--threads', '1', '--api-key', key],
                        { encoding: 'utf8', timeout: 20000 });
    assert.equal(r.status, 2, `--api-key '${key}': exit ${r.status} ${r.stderr}`);
    assert.match(r.stderr, /^moex: error: --api-key [^\n]+\n$/, r.stderr);
  }
});

await check('no key: 1 GB chunked body is refused with 401 after its head, nothing of it kept', async () => {
  const chunk = Buffer.from(`100000\r\n${'x'.repeat(0x100000)}\r\n`);
  let sent = 0;
  const r = await raw(main.port, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n',
                      { feed: () => (sent++ < 1024 ? chunk : null) });
  assert.deepEqual(statusOf(r.got), [401], r.got.slice(0, 200));
  assert.ok(r.closed, 'connection closed after the refusal');
  assert.ok(r.firstByte < 2000, `401 after ${r.firstByte} ms`);
  assert.ok(r.written < 256 << 20, `the server read ${r.written >> 20} MB of an unauthenticated body`);
  assertRss(main.child, baseRss, 64);
});

await check('no key: Content-Length 1 GB is refused with 401 at once', async () => {
  const r = await raw(main.port, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{',
                      { endOnReply: true });
  assert.deepEqual(statusOf(r.got), [401], r.got.slice(0, 200));
  assert.ok(r.firstByte < 2000, `401 after ${r.firstByte} ms`);
});

await check('key: chunked body over 8 MB is a 413, a small chunked body is served', async () => {
  const chunk = Buffer.from(`10000\r\n${'x'.repeat(0x10000)}\r\n`);
  let sent = 0;
  const big = await raw(main.port, `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\n` +
                                   'Transfer-Encoding: chunked\r\n\r\n', { feed: () => (sent++ < 4096 ? chunk : null) });
  assert.deepEqual(statusOf(big.got), [413], big.got.slice(0, 200));
  assert.ok(big.closed && big.written < 64 << 20, `413 after ${big.written >> 20} MB written`);
  assertRss(main.child, baseRss, 128);
  const body = JSON.stringify({ prompt: 'Once upon a time', max_tokens: 2 });
  const half = body.length >> 1;
  const small = await raw(main.port, `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\n` +
                          `Transfer-Encoding: chunked\r\n\r\n${half.toString(16)}\r\n${body.slice(0, half)}\r\n` +
                          `${(body.length - half).toString(16)};ext=1\r\n${body.slice(half)}\r\n0\r\n\r\n`,
                          { endOnReply: true });
  assert.deepEqual(statusOf(small.got), [200], small.got.slice(0, 300));
  assert.match(small.got, /"completion_tokens":2/);
});

await check('bad Content-Length (-5, 2^64+1, two that differ) and Transfer-Encoding beside it: 400 at once', async () => {
  for (const fields of ['Content-Length: -5', 'Content-Length: 18446744073709551617', 'Content-Length: 5\r\nContent-Length: 6',
                        'Content-Length: 5\r\nTransfer-Encoding: chunked']) {
    const r = await raw(main.port, `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\n${fields}\r\n\r\n`,
                        { timeoutMs: 5000 });
    assert.deepEqual(statusOf(r.got), [400], `${fields}: ${r.got.slice(0, 200)}`);
    assert.ok(r.closed && r.firstByte < 1000, `${fields}: answered after ${r.firstByte} ms, closed ${r.closed}`);
  }
});

await check('pipelining: three requests in one packet get three responses, in order', async () => {
  const post = (n) => {
    const body = JSON.stringify({ prompt: 'Once upon a time', max_tokens: n, temperature: 0, ignore_eos: true });
    return `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\nContent-Type: application/json\r\n` +
           `Content-Length: ${body.length}\r\n\r\n${body}`;
  };
  const r = await raw(main.port, post(1) + post(2) + 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n' + post(3),
                      { timeoutMs: 8000, until: (got) => (got.match(/"completion_tokens"/g) ?? []).length === 3 });
  assert.deepEqual(statusOf(r.got), [200, 200, 200, 200], r.got);
  const tokens = [...r.got.matchAll(/"completion_tokens":(\d+)/g)].map((m) => Number(m[1]));
  assert.deepEqual(tokens, [1, 2, 3]);
  assert.ok(!r.closed, 'the connection stays open for more');
});

await check('a prompt of 2.7M words (8 MB) is refused by its length before tokenizing; six at once stay bounded', async () => {
  const body = JSON.stringify({ prompt: 'hi '.repeat(2_700_000), max_tokens: 4 });
  const chat = JSON.stringify({ messages: [{ role: 'user', content: 'hi '.repeat(2_700_000) }], max_tokens: 4 });
  const start = Date.now();
  const results = await Promise.all([...Array(6)].map((_, i) =>
    fetch(`${main.url}/v1/${i % 2 ? 'chat/completions' : 'completions'}`,
          { method: 'POST', headers: { ...auth, 'Content-Type': 'application/json' }, body: i % 2 ? chat : body })
      .then(async (res) => ({ status: res.status, body: await res.json() }))));
  const seconds = (Date.now() - start) / 1000;
  for (const r of results) {
    assert.equal(r.status, 400);
    assert.match(r.body.error.message, /maximum context length is 256 tokens/);
  }
  assert.ok(seconds < 10, `six refusals took ${seconds} s`);
  console.log(`# six 8 MB prompts: ${seconds} s, RSS ${baseRss.toFixed(0)} -> ${rssMB(main.child).toFixed(0)} MB`);
  assertRss(main.child, baseRss, 128);
});

await check('/health and /metrics need no key; /v1/models and unknown paths do', async () => {
  assert.equal((await fetch(`${main.url}/health`)).status, 200);
  assert.equal((await fetch(`${main.url}/metrics`)).status, 200);
  assert.equal((await fetch(`${main.url}/v1/models`)).status, 401);
  assert.equal((await fetch(`${main.url}/h%65alth`)).status, 401);  // only the plain spelling is open
  assert.equal((await fetch(`${main.url}/v1/models`, { headers: auth })).status, 200);
});

await check('a burst of 300 requests against 4 running + 4 waiting: only 200 and 429, then healthy', async () => {
  const body = JSON.stringify({ prompt: 'Once upon a time', max_tokens: 4, temperature: 0, ignore_eos: true });
  const statuses = await Promise.all([...Array(300)].map(() =>
    fetch(`${main.url}/v1/completions`, { method: 'POST', headers: { ...auth, 'Content-Type': 'application/json' }, body })
      .then((r) => r.status, (e) => `error ${e.cause?.code ?? e.message}`)));
  const count = (s) => statuses.filter((x) => x === s).length;
  console.log(`# burst: ${count(200)} x 200, ${count(429)} x 429`);
  assert.ok(count(200) >= 8 && count(429) >= 1, `200: ${count(200)}, 429: ${count(429)}, other: ` +
            JSON.stringify(statuses.filter((x) => x !== 200 && x !== 429).slice(0, 5)));
  assert.equal(count(200) + count(429), 300);
  assert.equal((await fetch(`${main.url}/health`)).status, 200);
  const after = await fetch(`${main.url}/v1/completions`, { method: 'POST', headers: auth, body });
  assert.equal(after.status, 200);
});

await stopServer(main);

await check('--metrics-require-key: /metrics needs the key, /health does not; it needs --api-key', async () => {
  const s = await startServer(['--api-key', KEY, '--metrics-require-key', '--max-num-seqs', '1', '--max-batch-tokens', '64']);
  assert.match(s.access, /all but \/, \/health\)/);
  assert.equal((await fetch(`${s.url}/metrics`)).status, 401);
  assert.equal((await fetch(`${s.url}/metrics`, { headers: auth })).status, 200);
  assert.equal((await fetch(`${s.url}/health`)).status, 200);
  await stopServer(s);
  const r = spawnSync(moex, ['serve', '--model', model, '--port', '0', '--threads', '1', '--metrics-require-key'],
                      { encoding: 'utf8', timeout: 20000 });
  assert.equal(r.status, 2, r.stderr);
  const open = await startServer(['--max-num-seqs', '1', '--max-batch-tokens', '64']);
  assert.match(open.access, /no API key/);
  await stopServer(open);
});

await check('SIGTERM as soon as the start-up line is out: the server exits 0 (x3)', async () => {
  for (let i = 0; i < 3; i++) {
    const s = await startServer(['--max-num-seqs', '1', '--max-batch-tokens', '64']);
    const end = await Promise.race([stopServer(s), new Promise((r) => setTimeout(() => r('timeout'), 10000))]);
    assert.deepEqual(end, { code: 0, signal: null }, `run ${i}`);
  }
});

finish('hostile-client checks');
