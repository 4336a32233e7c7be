// A headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
// separated by NUL bytes on file descriptors 3 and 4), with no npm package: enough to open a page, run
// script in it, and collect what it logged.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

// Debian's chromium-headless-shell (the smaller package), else a full chromium; MOEX_CHROMIUM=PATH names the
// one to use (and only that one).
export function findChromium() {
  const candidates = process.env.MOEX_CHROMIUM ? [process.env.MOEX_CHROMIUM]
                                               : ['/usr/bin/chromium-headless-shell', '/usr/bin/chromium'];
  return candidates.find((c) => existsSync(c)) || null;
}

export class Browser {
  static async launch(executable, { width = 1280, height = 860 } = {}) {
    const profile = mkdtempSync(join(tmpdir(), 'moex-chromium-'));
    const args = ['--headless', '--remote-debugging-pipe', `--user-data-dir=${profile}`, '--no-first-run',
                  '--no-default-browser-check', '--disable-gpu', '--disable-extensions', '--disable-sync',
                  '--disable-background-networking', '--disable-dev-shm-usage', '--mute-audio',
                  `--window-size=${width},${height}`, 'about:blank'];
    if (process.getuid && process.getuid() === 0) args.unshift('--no-sandbox');  // Chromium refuses root with its sandbox
    const child = spawn(executable, args, { stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'] });
    const browser = new Browser(child, profile);
    await browser.send('Target.getTargets');  // the pipe answers: the browser is up
    return browser;
  }

  constructor(child, profile) {
    this.child = child;
    this.profile = profile;
    this.nextId = 1;
    this.pending = new Map();
    this.listeners = [];
    this.stderr = '';
    this.exited = false;
    child.stderr.on('data', (d) => { this.stderr = (this.stderr + d.toString()).slice(-4000); });
    let buffer = Buffer.alloc(0);
    child.stdio[4].on('data', (d) => {
      buffer = Buffer.concat([buffer, d]);
      let end;
      while ((end = buffer.indexOf(0)) >= 0) {
        const message = JSON.parse(buffer.subarray(0, end).toString('utf8'));
        buffer = buffer.subarray(end + 1);
        if (message.id !== undefined && this.pending.has(message.id)) {
          const { resolve, reject, method } = this.pending.get(message.id);
          this.pending.delete(message.id);
          if (message.error) reject(new Error(`${method}: ${message.error.message}`));
          else resolve(message.result);
        } else if (message.method) {
          for (const l of this.listeners) l(message);
        }
      }
    });
    const fail = (why) => {
      this.exited = true;
      for (const { reject, method } of this.pending.values()) reject(new Error(`chromium ${why} during ${method}: ${this.stderr}`));
      this.pending.clear();
    };
    child.on('exit', (code, signal) => fail(`exited (${code ?? signal})`));
    child.on('error', (e) => fail(`failed to start (${e.message})`));
    for (const fd of [3, 4]) child.stdio[fd].on('error', (e) => fail(`closed its pipe (${e.code})`));
  }

  send(method, params = {}, sessionId = undefined) {
    return new Promise((resolve, reject) => {
      if (this.exited) return reject(new Error(`chromium has exited: ${this.stderr}`));
      const id = this.nextId++;
      this.pending.set(id, { resolve, reject, method });
      this.child.stdio[3].write(JSON.stringify({ id, method, params, ...(sessionId ? { sessionId } : {}) }) + '\0');
    });
  }

  on(listener) { this.listeners.push(listener); }

  // A new tab at about:blank, attached: a Page whose events (console, exceptions, log) are recorded.
  async newPage({ width = 1280, height = 860 } = {}) {
    const { targetId } = await this.send('Target.createTarget', { url: 'about:blank' });
    const { sessionId } = await this.send('Target.attachToTarget', { targetId, flatten: true });
    const page = new Page(this, sessionId);
    for (const domain of ['Page', 'Runtime', 'Log', 'Network']) await page.send(`${domain}.enable`);
    await page.send('Emulation.setDeviceMetricsOverride', { width, height, deviceScaleFactor: 1, mobile: false });
    return page;
  }

  async close() {
    if (!this.exited) {
      const exited = new Promise((resolve) => this.child.on('exit', resolve));
      this.send('Browser.close').catch(() => {});
      const timer = setTimeout(() => this.child.kill('SIGKILL'), 5000);
      await exited;
      clearTimeout(timer);
    }
    rmSync(this.profile, { recursive: true, force: true });
  }
}

export class Page {
  constructor(browser, sessionId) {
    this.browser = browser;
    this.sessionId = sessionId;
    this.console = [];     // {type, text} of console.* calls
    this.exceptions = [];  // uncaught exceptions' descriptions
    this.log = [];         // {level, source, text, url} of the browser's own log (failed loads, CSP violations)
    this.requests = [];    // URLs the page requested
    this.waiters = [];
    browser.on((m) => {
      if (m.sessionId !== sessionId) return;
      if (m.method === 'Runtime.consoleAPICalled')
        this.console.push({ type: m.params.type, text: m.params.args.map((a) => a.value ?? a.description ?? '').join(' ') });
      else if (m.method === 'Runtime.exceptionThrown')
        this.exceptions.push(m.params.exceptionDetails.exception?.description ?? m.params.exceptionDetails.text);
      else if (m.method === 'Log.entryAdded') this.log.push(m.params.entry);
      else if (m.method === 'Network.requestWillBeSent') this.requests.push(m.params.request.url);
      for (const w of [...this.waiters]) {
        if (w.method === m.method) {
          this.waiters.splice(this.waiters.indexOf(w), 1);
          w.resolve(m.params);
        }
      }
    });
  }

  send(method, params = {}) { return this.browser.send(method, params, this.sessionId); }

  event(method, timeoutMs = 15000) {
    return new Promise((resolve, reject) => {
      const waiter = { method, resolve };
      this.waiters.push(waiter);
      setTimeout(() => {
        const i = this.waiters.indexOf(waiter);
        if (i >= 0) { this.waiters.splice(i, 1); reject(new Error(`no ${method} within ${timeoutMs} ms`)); }
      }, timeoutMs);
    });
  }

  async goto(url) {
    const loaded = this.event('Page.loadEventFired');
    const { errorText } = await this.send('Page.navigate', { url });
    if (errorText) throw new Error(`navigating to ${url}: ${errorText}`);
    await loaded;
  }

  // The value of `expression` (awaited when it is a promise); a thrown error becomes this call's error.
  async evaluate(expression) {
    const r = await this.send('Runtime.evaluate', { expression, awaitPromise: true, returnByValue: true });
    if (r.exceptionDetails)
      throw new Error(`in the page: ${r.exceptionDetails.exception?.description ?? r.exceptionDetails.text}`);
    return r.result.value;
  }

  // Polls `expression` until it is truthy; returns its value.
  async waitFor(expression, { timeoutMs = 15000, what = expression } = {}) {
    const until = Date.now() + timeoutMs;
    for (;;) {
      const v = await this.evaluate(expression);
      if (v) return v;
      if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  async screenshot() {
    const { data } = await this.send('Page.captureScreenshot', { format: 'png' });
    return Buffer.from(data, 'base64');
  }
}
