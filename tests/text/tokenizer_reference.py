"""The reference side of tokenizer_reference_test.cpp: Hugging Face's tokenizers library (the Python
package of the project's venv, requirements.txt) encodes every document of a corpus file, each a
4-byte little-endian length and its bytes, decoded as UTF-8 the lossy way (each ill-formed subpart
becomes U+FFFD). Writes one JSON object per document: its ids, and the reference's decode of them
(special tokens kept).

usage: tokenizer_reference.py TOKENIZER_JSON CORPUS OUT ADD_SPECIAL(0|1)
"""
import json
import struct
import sys

from tokenizers import Tokenizer


def main():
    tokenizer_path, corpus_path, out_path, special = sys.argv[1:5]
    tokenizer = Tokenizer.from_file(tokenizer_path)
    corpus = open(corpus_path, "rb").read()
    docs, at = [], 0
    while at < len(corpus):
        (n,) = struct.unpack_from("<I", corpus, at)
        at += 4
        docs.append(corpus[at:at + n].decode("utf-8", errors="replace"))
        at += n
    encodings = tokenizer.encode_batch(docs, add_special_tokens=special == "1")
    with open(out_path, "w", encoding="utf-8") as f:
        for e in encodings:
            f.write(json.dumps({"ids": e.ids, "decoded": tokenizer.decode(e.ids, skip_special_tokens=False)}) + "\n")


if __name__ == "__main__":
    main()
