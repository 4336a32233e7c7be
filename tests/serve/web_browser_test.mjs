// The web page of `moex serve` in a real browser: Debian's headless Chromium over the DevTools protocol
// (cdp.mjs). Usage: node web_browser_test.mjs MOEX_BINARY [SCREENSHOT.png]; MOEX_WEB_TEST_MODEL=DIR serves
// that model instead of a fresh `small` one. Exits 77 (ctest: skipped) with the reason when there is no Chromium.
// - the page loads with no console error and no exception, asks for the API key once (one 401), and requests
//   nothing but this server;
// - replies are rendered as Markdown (code fences, inline code, emphasis, lists) with the text HTML-escaped;
// - a chat message streams in (the reply on the page grows several times while the request runs), with TTFT
//   and tokens/s shown;
// - Stop cancels the request on the server: /metrics counts it as aborted before its 3500 tokens, and the
//   engine runs nothing;
// - the engine charts update while a load runs (tokens/s and the expert heat map from the stats endpoint);
// - a screenshot is saved (the build folder's web_page.png by default: the test's artifact).
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { Browser, findChromium } from './cdp.mjs';
import { check, finish, startServer, stopAll, workFolder } from './harness.mjs';

const moex = process.argv[2];
assert.ok(moex, 'usage: node web_browser_test.mjs MOEX_BINARY [SCREENSHOT.png]');
const screenshotPath = resolve(process.argv[3] ?? 'web_page.png');
const chromium = findChromium();
if (!chromium) {
  console.log(`SKIP: no headless Chromium (${process.env.MOEX_CHROMIUM || '/usr/bin/chromium-headless-shell or /usr/bin/chromium'}; ` +
              'scripts/install-deps.sh --test installs it)');
  process.exit(77);
}

let model = process.env.MOEX_WEB_TEST_MODEL;
if (!model) {
  model = join(workFolder('moex-web-browser-'), 'small');  // 4 layers: a heat map with rows, a few ms a step
  execFileSync(moex, ['gen-model', '--preset', 'small', '--seed', '7', '--out', model], { stdio: 'ignore' });
}
const KEY = 'browser-test-key';
const server = await startServer(moex, model, ['--api-key', KEY, '--max-num-seqs', '8', '--max-batch-tokens', '128',
                                               '--max-model-len', '4096']);
const auth = { Authorization: `Bearer ${KEY}` };
const aborted = async () => {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const m = text.match(/^moex:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$/m);
  return m ? Number(m[1]) : NaN;
};
const stats = async () => (await fetch(`${server.url}/v1/engine/stats`, { headers: auth })).json();

let browser;
try {
  browser = await Browser.launch(chromium);
} catch (e) {
  console.log(`SKIP: ${chromium} does not start here: ${e.message.split('\n')[0]}`);
  stopAll();
  process.exit(77);
}
const page = await browser.newPage();

await check('the page loads, asks for the key once, and shows the model', async () => {
  await page.goto(`${server.url}/`);
  await page.waitFor(`document.getElementById('keybox').classList.contains('open')`, { what: 'the key prompt' });
  await page.evaluate(`document.getElementById('key-input').value = ${JSON.stringify(KEY)};
                       document.querySelector('#key-form button').click(); true`);
  const name = await page.waitFor(`document.getElementById('model-name').textContent`, { what: 'the model name' });
  assert.ok(name.startsWith((await (await fetch(`${server.url}/v1/models`, { headers: auth })).json()).data[0].id), name);
  await page.waitFor(`Number(document.body.dataset.statsUpdates) >= 2`, { what: 'two stats updates' });
  assert.equal(await page.evaluate(`sessionStorage.getItem('moex-api-key')`), KEY);
});

await check('replies render as Markdown after HTML is escaped', async () => {
  const md = (text) => page.evaluate(`markdown(${JSON.stringify(text)})`);
  assert.equal(await md('<img src=x onerror=alert(1)> & "q"'), '<p>&lt;img src=x onerror=alert(1)&gt; &amp; &quot;q&quot;</p>');
  assert.equal(await md('**bold**, *it*, `a *b* <c>`'),
               '<p><strong>bold</strong>, <em>it</em>, <code>a *b* &lt;c&gt;</code></p>');
  assert.equal(await md('Code:\n```js"><script>\nif (a < b) x = "</pre>";\n```\nafter'),
               '<p>Code:</p><pre><code data-lang="jsscript">if (a &lt; b) x = &quot;&lt;/pre&gt;&quot;;\n</code></pre><p>after</p>');
  assert.equal(await md('## Title\n- one\n- two\n\n1. first'),
               '<h3>Title</h3><ul><li>one</li><li>two</li></ul><ol><li>first</li></ol>');
  assert.equal(await md('```\nstill streaming <b>'), '<pre><code>still streaming &lt;b&gt;</code></pre>');
});

await check('a message streams into the chat, with TTFT and tokens/s', async () => {
  // Records the reply's length at every change of the page while it streams.
  await page.evaluate(`window.growth = [];
    new MutationObserver(() => {
      const m = document.querySelector('#messages .msg.assistant:last-child');
      if (m && m.dataset.state === 'streaming') {
        const n = m.querySelector('.body').textContent.length;
        if (n > (window.growth[window.growth.length - 1] ?? 0)) window.growth.push(n);
      }
    }).observe(document.getElementById('messages'), { childList: true, subtree: true, characterData: true }); true`);
  await page.evaluate(`document.querySelector('details').open = true;
    document.getElementById('s-max-tokens').value = '200'; document.getElementById('s-temperature').value = '0';
    document.getElementById('s-ignore-eos').checked = true;
    document.getElementById('prompt').value = 'Hello, who are you?';
    document.getElementById('send').click(); true`);
  const last = `document.querySelector('#messages .msg.assistant:last-child')`;
  await page.waitFor(`${last} && ${last}.dataset.state === 'done'`, { what: 'the end of the reply', timeoutMs: 30000 });
  const growth = await page.evaluate('window.growth');
  const reply = await page.evaluate(`${last}.querySelector('.body').textContent`);
  assert.ok(growth.length >= 2 && growth[growth.length - 1] <= reply.length, `lengths seen while streaming: ${growth}`);
  assert.match(await page.evaluate(`${last}.querySelector('.stats').textContent`),
               /^TTFT \d+ ms · [\d.]+ tok\/s · 200 tokens · length$/);
  assert.equal(await page.evaluate(`document.getElementById('send').disabled`), false);
});

await check('Stop cancels the request on the server (aborted in /metrics)', async () => {
  const abortedBefore = await aborted();
  await page.evaluate(`document.getElementById('s-max-tokens').value = '3500';
    document.getElementById('prompt').value = 'Tell me a long story.';
    document.getElementById('send').click(); true`);
  const last = `document.querySelector('#messages .msg.assistant:last-child')`;
  await page.waitFor(`${last}.querySelector('.body').textContent.length > 0`, { what: 'the first tokens' });
  await page.evaluate(`document.getElementById('stop').click(); true`);
  await page.waitFor(`${last}.dataset.state === 'stopped'`, { what: 'the stopped state' });
  const until = Date.now() + 10000;
  while ((await aborted()) !== abortedBefore + 1 && Date.now() < until) await new Promise((r) => setTimeout(r, 100));
  assert.equal(await aborted(), abortedBefore + 1);
  const s = await stats();
  assert.equal(s.requests.running, 0);
  assert.ok(s.tokens.generated - 200 < 3500, `${s.tokens.generated} generated`);
  assert.match(await page.evaluate(`${last}.querySelector('.stats').textContent`), /stopped$/);
});

await check('the engine charts update while a load runs', async () => {
  // Eight streams of 500 tokens from outside the page: the page's charts must show them.
  const body = JSON.stringify({ prompt: 'The engine under load', max_tokens: 500, temperature: 0, ignore_eos: true });
  const load = Promise.all(Array.from({ length: 8 }, () => fetch(`${server.url}/v1/completions`, {
    method: 'POST', headers: { ...auth, 'Content-Type': 'application/json' }, body }).then((r) => r.json())));
  const seen = await page.waitFor(`(() => {
      const tps = Number(document.getElementById('v-gen-tps').textContent.replace('k', 'e3'));
      const batch = Number(document.getElementById('v-batch').textContent);
      return tps > 0 && batch > 1 && document.getElementById('heat-window').textContent === 'last active second' &&
             { tps, batch, running: Number(document.getElementById('v-running').textContent),
               zones: document.getElementById('l-zones').textContent, updates: Number(document.body.dataset.statsUpdates) };
    })()`, { what: 'the charts showing the load', timeoutMs: 30000 });
  assert.match(seen.zones, /attention [\d.]+/);
  assert.match(seen.zones, /experts [\d.]+/);
  assert.match(seen.zones, /router [\d.]+/);
  // The heat map's canvas has coloured cells (not only the empty background).
  const coloured = await page.evaluate(`(() => {
      const c = document.getElementById('heat'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && d[i] < 200 && d[i + 2] > d[i]) n++; return n; })()`);
  assert.ok(coloured > 100, `${coloured} coloured pixels`);
  writeFileSync(screenshotPath, await page.screenshot());
  console.log(`screenshot: ${screenshotPath}`);
  const later = await page.waitFor(`Number(document.body.dataset.statsUpdates) >= ${seen.updates + 2} &&
                                    Number(document.body.dataset.statsUpdates)`, { what: 'further updates' });
  assert.ok(later > seen.updates);
  const answers = await load;
  assert.equal(answers.reduce((n, a) => n + a.usage.completion_tokens, 0), 4000);
});

await check('no console error, no exception, one 401 (before the key), nothing requested elsewhere', async () => {
  assert.deepEqual(page.exceptions, []);
  assert.deepEqual(page.console.filter((c) => c.type === 'error' || c.type === 'warning'), []);
  const problems = page.log.filter((e) => e.level === 'error' || e.level === 'warning');
  assert.equal(problems.length, 1, JSON.stringify(problems));
  assert.match(problems[0].text, /401/);
  assert.match(problems[0].url, /\/v1\/models$/);
  const origin = new URL(server.url).origin;
  assert.deepEqual(page.requests.filter((u) => !u.startsWith(origin + '/') && !u.startsWith('data:') && u !== 'about:blank'), []);
});

await browser.close();
finish('browser checks');
