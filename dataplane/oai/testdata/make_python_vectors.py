"""Writes python_strings.jsonl: chat bodies whose message content is a JSON string literal
built from random pieces (valid and invalid escapes, raw UTF-8, invalid bytes, control
characters), each with what CPython's json.loads makes of it. Parse must agree.

Run from this folder: python3 make_python_vectors.py
"""
import base64, json, random

rng = random.Random(20261129)
PIECES = [
    b"a", b"Z", b" ", b"/", b"'", b"<", b"\x7f",                      # plain ASCII
    "é".encode(), "中".encode(), "😀".encode(), "\u2028".encode(), "\ufeff".encode(),
    b"\\\"", b"\\\\", b"\\/", b"\\b", b"\\f", b"\\n", b"\\r", b"\\t",  # short escapes
    b"\\u0041", b"\\u00e9", b"\\u00E9", b"\\u4e2d", b"\\u0000", b"\\u001f", b"\\uFFFF",
    b"\\ud83d\\ude00", b"\\uD834\\uDD1E",                              # surrogate pairs
    b"\\ud800", b"\\udc00", b"\\ud83dx", b"\\ude00\\ud83d", b"\\ud83d\\u0041",  # unpaired
    b"\\x", b"\\U0041", b"\\'", b"\\u12", b"\\u12G4", b"\\", b"\\ ",    # invalid escapes
    b"\x00", b"\x09", b"\x0a", b"\x1f",                                 # raw control chars
    b"\xff", b"\xc0\x80", b"\xe4\xb8", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80",  # bad UTF-8
]
# Weight valid pieces up so most strings are valid.
VALID = PIECES[:27]

with open("python_strings.jsonl", "w") as out:
    for i in range(600):
        pool = VALID if rng.random() < 0.6 else PIECES
        lit = b"".join(rng.choice(pool) for _ in range(rng.randrange(0, 8)))
        body = b'{"model":"m","messages":[{"role":"user","content":"' + lit + b'"}]}'
        case = {"body": base64.b64encode(body).decode()}
        try:
            content = json.loads(body)["messages"][0]["content"]
        except (ValueError, UnicodeDecodeError):
            case["ok"] = False
        else:
            case["ok"] = True
            try:
                case["content"] = base64.b64encode(content.encode("utf-8")).decode()
            except UnicodeEncodeError:
                case["lone_surrogate"] = True  # Python keeps it; no tokenizer can encode it
        out.write(json.dumps(case, sort_keys=True) + "\n")
