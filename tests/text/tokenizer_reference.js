// The reference side of tokenizer_reference_test.cpp: Hugging Face's tokenizers library (the
// native @anush008/tokenizers build) encodes every document of a corpus file, each a 4-byte
// little-endian length and its bytes, decoded as UTF-8 the lossy way (each ill-formed subpart
// becomes U+FFFD). Writes one JSON object per document: its ids, and the reference's decode of
// them (special tokens kept).
// usage: node tokenizer_reference.js TOKENIZER_JSON CORPUS OUT ADD_SPECIAL(0|1)
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');

async function main() {
  const [tokenizerPath, corpusPath, outPath, special] = process.argv.slice(2);
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const corpus = fs.readFileSync(corpusPath);
  const lines = [];
  for (let at = 0; at < corpus.length;) {
    const n = corpus.readUInt32LE(at);
    at += 4;
    const text = corpus.subarray(at, at + n).toString('utf8');
    at += n;
    const encoding = await tokenizer.encode(text, null, { addSpecialTokens: special === '1' });
    const ids = Array.from(encoding.getIds());
    lines.push(JSON.stringify({ ids, decoded: await tokenizer.decode(ids, false) }));
  }
  fs.writeFileSync(outPath, lines.join('\n') + '\n');
}
main().catch((e) => {
  console.error(e);
  process.exit(1);
});
