// What every tests/serve script needs: a work folder removed at exit, `moex serve` started on a free port of
// 127.0.0.1 (alone or under mpirun) and killed at exit, and named checks that count failures.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const children = new Set();
const folders = [];
process.on('exit', () => {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  for (const f of folders) rmSync(f, { recursive: true, force: true });
});
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(1));  // ctest's timeout: no orphans

// A fresh folder under the system's temporary one, removed when the script exits.
export function workFolder(prefix) {
  const folder = mkdtempSync(join(tmpdir(), prefix));
  folders.push(folder);
  return folder;
}

// Starts `moex serve --model MODEL --port 0 --threads 1 ARGS` (under `mpirun -np RANKS` when ranks > 1) and
// resolves once it listens: { child, url, port, banner (its stdout so far), access (what the start-up line
// says of the API key) }. Rejects when it exits first.
export function startServer(moex, model, args, { ranks = 1, mpirun = 'mpirun', env = {} } = {}) {
  return new Promise((resolve, reject) => {
    const serve = ['serve', '--model', model, '--port', '0', '--threads', '1', ...args];
    const options = { stdio: ['ignore', 'pipe', 'inherit'],
                      env: { ...process.env, OMPI_MCA_mpi_yield_when_idle: '1',
                             OMPI_MCA_btl_vader_single_copy_mechanism: 'none', ...env } };
    const child = ranks === 1
      ? spawn(moex, serve, options)
      : spawn(mpirun, ['--allow-run-as-root', '--oversubscribe', '-np', String(ranks), moex, ...serve], options);
    children.add(child);
    let out = '';
    child.stdout.on('data', (d) => {
      out += d.toString();
      const m = out.match(/listening on (http:\/\/127\.0\.0\.1:(\d+)) \(([^;]*);/);
      if (m) resolve({ child, url: m[1], port: Number(m[2]), banner: out, access: m[3] });
    });
    child.on('exit', (code) => reject(new Error(`moex serve --model ${model} exited with ${code}: ${out}`)));
  });
}

// SIGTERM; resolves with the exit { code, signal }.
export function stopServer(server) {
  const exited = new Promise((resolve) => {
    if (server.child.exitCode !== null || server.child.signalCode !== null)
      resolve({ code: server.child.exitCode, signal: server.child.signalCode });
    else server.child.on('exit', (code, signal) => resolve({ code, signal }));
  });
  server.child.kill('SIGTERM');
  return exited;
}

export function stopAll() {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGTERM');
}

let failures = 0;
// Runs one named check: "ok - NAME (ms)" or "not ok - NAME" with the error, counted.
export async function check(name, fn) {
  const start = Date.now();
  try {
    await fn();
    console.log(`ok - ${name} (${Date.now() - start} ms)`);
  } catch (e) {
    failures++;
    console.log(`not ok - ${name}\n${e.stack}`);
  }
}

// Prints the verdict and exits 0 when every check passed.
export function finish(what = 'checks') {
  stopAll();
  console.log(failures ? `${failures} check(s) failed` : `all ${what} passed`);
  process.exit(failures ? 1 : 0);
}
