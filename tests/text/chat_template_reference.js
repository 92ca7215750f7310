// The reference side of chat_template_test.cpp: Hugging Face's Jinja renderer for chat templates
// (@huggingface/jinja). Reads a JSON array of {template, context} cases and writes a JSON array of
// {text} or {error} results.
// usage: node chat_template_reference.js CASES OUT
const fs = require('fs');
const { Template } = require('@huggingface/jinja');

const [casesPath, outPath] = process.argv.slice(2);
const cases = JSON.parse(fs.readFileSync(casesPath, 'utf8'));
const results = cases.map(({ template, context }) => {
  try {
    return { text: new Template(template).render(context) };
  } catch (e) {
    return { error: String(e.message || e) };
  }
});
fs.writeFileSync(outPath, JSON.stringify(results));
