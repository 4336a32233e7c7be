// MoEX's tokenizer.json reader against Hugging Face's own implementation (npm `tokenizers`, the Rust library
// prebuilt): the same ids for every text of corpus.json (with and without special tokens), the same text
// for decoding them and for random id lists (byte tokens that form invalid UTF-8 included), and, with
// --roundtrip, decode(encode(text)) giving the text back (NFC-normalized for --roundtrip nfc).
// --variant rewrites a SentencePiece-style file into the other forms Hugging Face's converters write:
// "metaspace" (no normalizer, a Metaspace pre-tokenizer with prepend_scheme "first": Llama's legacy=false),
// "metaspace_split" (Metaspace "always" splitting at each "▁", decoded by ByteFallback, Fuse, Metaspace).
//   node check_hf.js --modules DIR --probe BIN --tokenizer DIR --corpus FILE --work DIR [--roundtrip exact|nfc]
//                    [--variant metaspace|metaspace_split|added_tokens|llama3|splits]
// ("added_tokens" adds non-special, normalized, lstrip/rstrip and overlapping added tokens to any file).
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || i + 1 >= argv.length) throw new Error(`bad argument ${argv[i]}`);
    args[argv[i].slice(2)] = argv[i + 1];
  }
  for (const k of ['modules', 'probe', 'tokenizer', 'corpus', 'work'])
    if (!args[k]) throw new Error(`--${k} is required`);
  return args;
}

// A small seeded generator (mulberry32), so a failure names lists that reproduce.
function rng(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const hexOf = (s) => Buffer.from(s, 'utf8').toString('hex');
const show = (hex) => JSON.stringify(Buffer.from(hex, 'hex').toString('utf8'));

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const { Tokenizer } = require(path.join(path.resolve(args.modules), 'tokenizers'));
  fs.mkdirSync(args.work, { recursive: true });
  if (args.variant) {
    const spec = JSON.parse(fs.readFileSync(path.join(args.tokenizer, 'tokenizer.json'), 'utf8'));
    const metaspace = { type: 'Metaspace', replacement: '\u2581', prepend_scheme: 'first', split: false };
    if (args.variant === 'added_tokens') {
      // Added tokens of every kind: not special, matched after normalization, stripping whitespace.
      let next = Math.max(...Object.values(spec.model.vocab), ...spec.added_tokens.map((t) => t.id)) + 1;
      const add = (content, fields) => spec.added_tokens.push({ id: next++, content, single_word: false, lstrip: false,
        rstrip: false, normalized: false, special: false, ...fields });
      add('<think>', {});
      add('</think>', { normalized: true });
      add('<mask>', { special: true, lstrip: true, rstrip: true });
      add('caf\u00e9', { normalized: true });
      add('<tool', { special: true });
      add('<tool_call>', { special: true });
    } else if (args.variant === 'llama3') {
      // Llama 3's shape on a byte-level file: its split regex (digits in threes), ignore_merges, and a
      // Sequence post-processor adding a BOS.
      spec.model.ignore_merges = true;
      spec.pre_tokenizer.pretokenizers[0].pattern.Regex =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
      const bos = spec.added_tokens[0];
      spec.post_processor = { type: 'Sequence', processors: [spec.post_processor, { type: 'TemplateProcessing',
        single: [{ SpecialToken: { id: bos.content, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
        pair: [], special_tokens: { [bos.content]: { id: bos.content, ids: [bos.id], tokens: [bos.content] } } }] };
    } else if (args.variant === 'splits') {
      // Every Split behaviour, inverted or not, String and Regex patterns, and Digits, before ByteLevel;
      // the other Unicode normal forms, with accents stripped by a Regex Replace between them.
      spec.normalizer = { type: 'Sequence', normalizers: [{ type: 'NFKD' }, { type: 'Replace',
        pattern: { Regex: '\\p{Mn}' }, content: '' }, { type: 'NFKC' }, { type: 'NFD' }] };
      const split = (pattern, behavior, invert) => ({ type: 'Split', pattern, behavior, invert });
      spec.pre_tokenizer = { type: 'Sequence', pretokenizers: [
        { type: 'Digits', individual_digits: false },
        split({ String: ' ' }, 'MergedWithPrevious', false),
        split({ Regex: '[aeiou\u00e9]' }, 'MergedWithNext', false),
        split({ Regex: '\\p{P}+' }, 'Contiguous', false),
        split({ String: 'q' }, 'Removed', false),
        split({ Regex: '[A-Z]' }, 'Isolated', true),
        { type: 'Digits', individual_digits: true },
        { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true }] };
    } else if (args.variant === 'metaspace') {
      spec.normalizer = null;
      spec.pre_tokenizer = metaspace;
    } else if (args.variant === 'metaspace_split') {
      spec.normalizer = null;
      spec.pre_tokenizer = { ...metaspace, prepend_scheme: 'always', split: true };
      spec.decoder = { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, { type: 'Fuse' },
                                                    { ...metaspace, prepend_scheme: 'always', split: true }] };
    } else {
      throw new Error(`unknown --variant ${args.variant}`);
    }
    const dir = path.join(args.work, args.variant);
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(spec));
    fs.copyFileSync(path.join(args.tokenizer, 'tokenizer_config.json'), path.join(dir, 'tokenizer_config.json'));
    args.tokenizer = dir;
  }
  const file = path.join(args.tokenizer, 'tokenizer.json');
  const hf = Tokenizer.fromFile(file);
  const spec = JSON.parse(fs.readFileSync(file, 'utf8'));
  const added = (spec.added_tokens || []).map((t) => t.content);
  const specials = (spec.added_tokens || []).filter((t) => t.special).map((t) => t.content);
  const corpus = JSON.parse(fs.readFileSync(args.corpus, 'utf8'));
  const vocab = hf.getVocabSize(true);

  // Id lists: random ids (a few past the vocabulary, which both skip), runs of byte tokens (valid and
  // invalid UTF-8 for byte_fallback), and every special token.
  const random = rng(1234);
  const idLists = [];
  for (let n = 0; n < 300; ++n) {
    const len = 1 + Math.floor(random() * 12);
    idLists.push(Array.from({ length: len }, () => Math.floor(random() * (vocab + 3))));
  }
  const byteId = (b) => hf.tokenToId(`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`);
  if (byteId(0xe4) !== undefined && byteId(0xe4) !== null) {
    const word = hf.tokenToId('\u2581the') ?? 5;
    for (const bytes of [[0xe4, 0xbd, 0xa0], [0xe4, 0xbd], [0xff], [0x41, 0xe4], [0xf0, 0x9f, 0x98, 0x80], [0x80, 0x80]]) {
      idLists.push(bytes.map(byteId));
      idLists.push([word, ...bytes.map(byteId), word]);
    }
  }
  idLists.push(added.map((t) => hf.tokenToId(t)));

  const casesPath = path.join(args.work, 'cases.json');
  const outPath = path.join(args.work, 'moex.json');
  fs.writeFileSync(casesPath, JSON.stringify({ texts: corpus.texts, id_lists: idLists }));
  execFileSync(args.probe, ['run', args.tokenizer, casesPath, outPath], { stdio: 'inherit' });
  const moex = JSON.parse(fs.readFileSync(outPath, 'utf8'));

  const failures = [];
  const expect = (ok, what) => { if (!ok) failures.push(what); };
  expect(moex.vocab_size === vocab, `vocab size: MoEX ${moex.vocab_size}, HF ${vocab}`);
  for (let i = 0; i < corpus.texts.length; ++i) {
    const c = corpus.texts[i];
    // What a host language hands `tokenizers`: Node's UTF-8 decoder replaces invalid bytes as MoEX does.
    const text = c.text !== undefined ? c.text : Buffer.from(c.hex, 'hex').toString('utf8');
    const m = moex.texts[i];
    const ids = (await hf.encode(text, null, { addSpecialTokens: true })).getIds();
    const plain = (await hf.encode(text, null, { addSpecialTokens: false })).getIds();
    const label = `text ${i} ${JSON.stringify(text)}`;
    expect(JSON.stringify(m.ids) === JSON.stringify(ids), `${label}: ids MoEX [${m.ids}] HF [${ids}]`);
    expect(JSON.stringify(m.ids_plain) === JSON.stringify(plain), `${label}: ids without specials MoEX [${m.ids_plain}] HF [${plain}]`);
    const decoded = hexOf(await hf.decode(ids, true));
    const kept = hexOf(await hf.decode(ids, false));
    expect(m.decoded === decoded, `${label}: decode MoEX ${show(m.decoded)} HF ${show(decoded)}`);
    expect(m.decoded_keep === kept, `${label}: decode keeping specials MoEX ${show(m.decoded_keep)} HF ${show(kept)}`);
    // Not round trips by design: a text holding a special token's text (it becomes the token), and under
    // SentencePiece's "▁" marking, a "▁" typed in the text (it decodes as a space).
    const roundtrips = !added.some((t) => text.includes(t)) && !(args.roundtrip === 'exact' && text.includes('\u2581'));
    if (args.roundtrip && roundtrips) {
      const want = args.roundtrip === 'nfc' ? text.normalize('NFC') : text;
      expect(m.roundtrip === hexOf(want), `${label}: round trip gives ${show(m.roundtrip)}`);
    }
  }
  // A run of byte tokens that is not UTF-8 as a whole: `tokenizers` writes U+FFFD for each of its tokens,
  // moex::Tokenizer keeps the bytes that form characters as SentencePiece does (check_sentencepiece.py checks
  // that); JsonTokenizer's own rule for it is `tokenizers`' (decoded_tokenizers).
  const byteOf = (id) => { const m = /^<0x([0-9A-F]{2})>$/.exec(hf.idToToken(id) ?? ''); return m ? parseInt(m[1], 16) : -1; };
  const utf8 = new TextDecoder('utf-8', { fatal: true });
  const brokenByteRun = (ids) => {
    const runs = [[]];
    for (const id of ids) {
      if (byteOf(id) >= 0) runs[runs.length - 1].push(byteOf(id));
      else if (hf.idToToken(id) != null && !specials.includes(hf.idToToken(id))) runs.push([]);  // skipped ids do not end one
    }
    return runs.some((r) => { try { utf8.decode(Buffer.from(r)); return false; } catch { return true; } });
  };
  let brokenRuns = 0;
  for (let i = 0; i < idLists.length; ++i) {
    const m = moex.id_lists[i];
    const decoded = hexOf(await hf.decode(idLists[i], true));
    const kept = hexOf(await hf.decode(idLists[i], false));
    expect(m.decoded_tokenizers === decoded, `ids [${idLists[i]}]: decode MoEX ${show(m.decoded_tokenizers)} HF ${show(decoded)}`);
    if (brokenByteRun(idLists[i])) ++brokenRuns;
    else expect(m.decoded === decoded, `ids [${idLists[i]}]: moex::Tokenizer decode ${show(m.decoded)} HF ${show(decoded)}`);
    expect(m.decoded_keep === kept, `ids [${idLists[i]}]: decode keeping specials MoEX ${show(m.decoded_keep)} HF ${show(kept)}`);
  }
  const checks = corpus.texts.length + idLists.length;
  if (failures.length) {
    for (const f of failures.slice(0, 25)) console.log(`MISMATCH ${f}`);
    console.log(`${file}: ${failures.length} mismatches against Hugging Face tokenizers over ${checks} cases`);
    process.exit(1);
  }
  console.log(`${file}: ${corpus.texts.length} texts and ${idLists.length} id lists agree with Hugging Face tokenizers ` +
              `(${brokenRuns} lists with a byte run that is not UTF-8 through JsonTokenizer's rule only)`);
}

main().catch((e) => { console.error(`check_hf.js: ${e.stack || e}`); process.exit(1); });
