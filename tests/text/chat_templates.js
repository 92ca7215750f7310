// Chat templates of models whose tokenizer packages carry none (Mixtral, Mistral, Llama-2,
// Llama-3.1), as Hugging Face's @huggingface/ollama-utils records them (the Jinja template each
// model's GGUF file holds, which is its tokenizer_config.json's). The package keeps the list in a
// module it does not export, so the source is read and evaluated. Writes {name: template}.
// usage: node chat_templates.js OUT NAME...
const fs = require('fs');
const path = require('path');

const [outPath, ...names] = process.argv.slice(2);
// The package's folder: the first NODE_PATH entry that holds it (its exports hide package.json).
const dir = (process.env.NODE_PATH || '').split(path.delimiter).map((p) => path.join(p, '@huggingface', 'ollama-utils'))
  .find((p) => fs.existsSync(path.join(p, 'src')));
if (!dir) {
  console.error('@huggingface/ollama-utils is not under NODE_PATH');
  process.exit(1);
}
let src = fs.readFileSync(path.join(dir, 'src', 'chat-template-automap.ts'), 'utf8');
src = src.replace(/^import type .*$/m, '').replace(/export const OLLAMA_CHAT_TEMPLATE_MAPPING\s*:\s*[^=]+=/, 'module.exports =');
const mod = { exports: [] };
new Function('module', src)(mod);
const out = {};
for (const name of names) {
  const entry = mod.exports.find((e) => e.model === 'library/' + name);
  if (!entry) {
    console.error('no template for ' + name);
    process.exit(1);
  }
  out[name] = entry.gguf;
}
fs.writeFileSync(outPath, JSON.stringify(out));
