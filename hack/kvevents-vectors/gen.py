#!/usr/bin/python3
"""Writes the KV event test vectors of engines/kvevents/testdata with an implementation of
msgpack that is independent of kvrelay's (Debian's python3-msgpack).

Run once from the repository root, and again only when a vector is added:

    /usr/bin/python3 hack/kvevents-vectors/gen.py

For every vector NAME it writes

    engines/kvevents/testdata/vectors/NAME.msgpack   the bytes, packed by python3-msgpack
    engines/kvevents/testdata/vectors/NAME.json      {"source", "canonical", "batch"}

where "batch" is the vector decoded by normalize() below into kvrelay's canonical JSON form
(the same form the Go tests build from a decoded kvevents.Batch), and "canonical" names the
kvevents.Format ("map" or "array") whose AppendBatch output must equal the bytes exactly, or
null when the vector uses a layout kvrelay never writes (signed hashes, tag last, ...).

It also writes the public captures under engines/kvevents/testdata/captures (see the
README there): the raw bytes of one, and another re-packed from the Python object its
reporter printed.

normalize() is a second, independent reading of the wire format (vLLM's
vllm/distributed/kv_events.py); keep it free of anything copied from the Go decoder.
"""

import json
import os
import sys

import msgpack

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OUT = os.path.join(ROOT, "engines", "kvevents", "testdata")

U64 = (1 << 64) - 1

STORED_FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx"]


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# normalize: wire object -> canonical JSON
# ---------------------------------------------------------------------------------------------

def norm_hash(h):
    if isinstance(h, bool):
        raise ValueError("bool hash")
    if isinstance(h, int):
        return "u:%d" % (h & U64)
    if isinstance(h, str):
        h = h.encode("utf-8")
    if isinstance(h, (bytes, bytearray)):
        if len(h) == 0:
            return "u:0"
        return "b:" + bytes(h).hex()
    raise ValueError("bad hash %r" % (h,))


def norm_tokens(toks):
    if not isinstance(toks, list):
        raise ValueError("token_ids not a list")
    if toks and isinstance(toks[0], list):
        out = [toks[0][0]]
        for pair in toks:
            if len(pair) != 2 or pair[0] != out[-1]:
                raise ValueError("bigram pairs do not chain")
            out.append(pair[1])
        return out, True
    for t in toks:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t > 0xFFFFFFFF:
            raise ValueError("bad token %r" % (t,))
    return list(toks), False


def opt_int(v, strict):
    if v is None:
        return None, True
    if isinstance(v, int) and not isinstance(v, bool):
        return v, True
    if strict:
        raise ValueError("not an int: %r" % (v,))
    return None, False


def opt_str(v, strict):
    if v is None or v == "":
        return None, True
    if isinstance(v, str):
        return v, True
    if strict:
        raise ValueError("not a str: %r" % (v,))
    return None, False


def norm_fields(fields):
    """fields: dict of wire field name -> value for one known event (strict core fields,
    extensions dropped when mistyped)."""
    ev = {
        "block_hashes": [], "parent": None, "token_ids": [], "bigram": False,
        "block_size": 0, "lora_id": None, "medium": None, "lora_name": None,
        "extra_keys": None, "group_idx": None, "kv_cache_spec_kind": None,
        "sliding_window": None, "locality": None, "ownership": None, "session_id": None,
    }
    if "block_hashes" in fields:
        hs = fields["block_hashes"]
        if not isinstance(hs, list):
            raise ValueError("block_hashes not a list")
        ev["block_hashes"] = [norm_hash(h) for h in hs]
    if fields.get("parent_block_hash") is not None:
        ev["parent"] = norm_hash(fields["parent_block_hash"])
    if "token_ids" in fields:
        ev["token_ids"], ev["bigram"] = norm_tokens(fields["token_ids"])
    if "block_size" in fields:
        v = fields["block_size"]
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError("block_size")
        ev["block_size"] = v
    if "lora_id" in fields:
        ev["lora_id"], _ = opt_int(fields["lora_id"], True)
    if "medium" in fields:
        ev["medium"], _ = opt_str(fields["medium"], True)
    if "lora_name" in fields:
        ev["lora_name"], _ = opt_str(fields["lora_name"], False)
    if isinstance(fields.get("extra_keys"), list):
        ev["extra_keys"] = [None if k is None else pack(k).hex() for k in fields["extra_keys"]]
    if "group_idx" in fields:
        ev["group_idx"], _ = opt_int(fields["group_idx"], False)
    if "kv_cache_spec_kind" in fields:
        ev["kv_cache_spec_kind"], _ = opt_str(fields["kv_cache_spec_kind"], False)
    if "kv_cache_spec_sliding_window" in fields:
        ev["sliding_window"], _ = opt_int(fields["kv_cache_spec_sliding_window"], False)
    for k in ("locality", "ownership", "session_id"):
        if k in fields:
            ev[k], _ = opt_str(fields[k], False)
    return ev


def norm_event(obj):
    """Returns the canonical event, or None for an unknown tag."""
    if isinstance(obj, list):
        tag = obj[0]
        layout = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, [])
        fields = dict(zip(layout, obj[1:]))
    elif isinstance(obj, dict):
        tag = obj["type"]
        fields = {k: v for k, v in obj.items() if k != "type"}
    else:
        raise ValueError("event is neither list nor map")
    if tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        return None
    ev = norm_fields(fields)
    if tag == "BlockStored":
        return dict(type=tag, **ev)
    if tag == "BlockRemoved":
        return {"type": tag, "block_hashes": ev["block_hashes"], "medium": ev["medium"],
                "group_idx": ev["group_idx"], "locality": ev["locality"],
                "ownership": ev["ownership"]}
    return {"type": tag}


def normalize(obj):
    if isinstance(obj, list):
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    else:
        ts, events, dp = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    out, skipped = [], 0
    for e in events:
        n = norm_event(e)
        if n is None:
            skipped += 1
        else:
            out.append(n)
    return {"ts": float(ts), "dp_rank": dp, "skipped": skipped, "events": out}


# ---------------------------------------------------------------------------------------------
# builders for events as vLLM's msgspec structs lay them out (omit_defaults)
# ---------------------------------------------------------------------------------------------

def stored_map(hashes, parent, tokens, block_size, lora_id=None, medium="GPU", lora_name=None,
               extra_keys=None, group_idx=None, spec_kind=None, window=None, locality=None,
               ownership=None, session_id=None):
    m = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": tokens, "block_size": block_size, "lora_id": lora_id, "medium": medium,
         "lora_name": lora_name}
    if extra_keys is not None:
        m["extra_keys"] = extra_keys
    if group_idx is not None:
        m["group_idx"] = group_idx
    if spec_kind is not None:
        m["kv_cache_spec_kind"] = spec_kind
    if window is not None:
        m["kv_cache_spec_sliding_window"] = window
    for k, v in (("locality", locality), ("ownership", ownership), ("session_id", session_id)):
        if v is not None:
            m[k] = v
    return m


def removed_map(hashes, medium="GPU", group_idx=None, locality=None, ownership=None):
    m = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group_idx is not None:
        m["group_idx"] = group_idx
    if locality is not None:
        m["locality"] = locality
    if ownership is not None:
        m["ownership"] = ownership
    return m


def trim(arr, minimum):
    while len(arr) > minimum and arr[-1] is None:
        arr.pop()
    return arr


def stored_array(hashes, parent, tokens, block_size, lora_id=None, medium=None, lora_name=None,
                 extra_keys=None, group_idx=None, spec_kind=None, window=None):
    return trim(["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name,
                 extra_keys, group_idx, spec_kind, window], 6)


def removed_array(hashes, medium=None, group_idx=None):
    return trim(["BlockRemoved", hashes, medium, group_idx], 2)


def toks(start, n):
    return [(start * 7919 + i * 104729) % 200000 for i in range(n)]


H1 = 15760518052499183552  # above 2^63, from the vLLM 0.26 capture
H2 = 3183184509886770661
H3 = 17080687294271316042
H4 = 805449029435203383
SHA = bytes(range(32))

VECTORS = [
    ("map_stored_basic", "map", "one BlockStored as vLLM >= #42892 sends it",
     [1789095808.8378847, [stored_map([H1, H2], None, toks(1, 32), 16, extra_keys=[None, None],
                                      group_idx=0, spec_kind="full_attention")], 0]),
    ("map_mixed", "map", "stored with a parent above 2^63, removed, cleared; dp rank 1",
     [1761816192.1347115, [
         stored_map([H3], H1, toks(2, 16), 16, extra_keys=[None], group_idx=0,
                    spec_kind="full_attention"),
         removed_map([H2, H4], group_idx=0),
         {"type": "AllBlocksCleared"},
     ], 1]),
    ("map_full_fields", "map", "every BlockStored field set, sliding-window group",
     [1.5, [stored_map([H2, H4], H3, toks(3, 8), 4, lora_id=7, medium="CPU",
                       lora_name="sql-adapter", extra_keys=[["mm-hash-a", 12], None],
                       group_idx=1, spec_kind="sliding_window", window=128)], 3]),
    ("map_large", "map", "array16 headers, 2-byte ints, str8 and bin hashes",
     [1700000000.25, [
         stored_map(list(range(1 << 40, (1 << 40) + 20)), None, toks(4, 320), 16,
                    lora_name="a-rather-long-adapter-name-of-forty-chars", group_idx=0),
         stored_map([SHA, SHA[::-1]], SHA, toks(5, 32), 16, medium="GPU"),
         removed_map([SHA], medium="GPU"),
     ], 0]),
    ("map_offload_tiers", "map",
     "vLLM offloading: a GPU store for a session, its CPU copy, a shared fs tier's copy "
     "(REMOTE, owned), a placeholder chunk (block_size 0, no tokens), per-tier removals",
     [1800000000.5, [
         stored_map([H1, H2], None, toks(13, 32), 16, extra_keys=[None, None], group_idx=0,
                    spec_kind="full_attention", session_id="sess-42"),
         stored_map([H1, H2], None, toks(13, 32), 16, medium="CPU", locality="LOCAL"),
         stored_map([H1, H2], None, toks(13, 32), 16, medium="STORAGE", locality="REMOTE",
                    ownership="fs"),
         stored_map([H3], None, [], 0, medium="CPU", locality="LOCAL"),
         removed_map([H2], medium="CPU", locality="LOCAL"),
         removed_map([H1, H2], medium="STORAGE", locality="REMOTE", ownership="fs"),
     ], 0]),
    ("map_empty", "map", "a batch with no events",
     [0.0, [], 0]),
    ("array_stored_legacy", "array", "vLLM before #42892: 7-element tagged array",
     [1767666073.8055613, [stored_array([H1], H3, toks(6, 16), 16, medium="GPU")], 0]),
    ("array_legacy_short", "array", "vLLM 0.9 layout: no medium, batch without dp rank",
     [12.0, [stored_array([H2], None, toks(7, 16), 16), removed_array([H2]),
             ["AllBlocksCleared"]]]),
    ("array_full_fields", "array", "every positional field up to the sliding window",
     [2.75, [stored_array([H4], H1, toks(8, 4), 4, lora_id=3, medium="GPU", lora_name="x",
                          extra_keys=[[b"\x01\x02", "salt"]], group_idx=2,
                          spec_kind="sliding_window", window=4096),
             removed_array([H4], medium="GPU", group_idx=2)], 0]),
    ("array_sim_parent_zero", "array", "simulator style: parent 0, empty tokens, CPU tier",
     [3.0, [stored_array([H2, H3], 0, [], 0, medium="CPU")], 0]),
    ("array_bigram", "array", "SGLang EAGLE bigram token pairs",
     [4.0, [stored_array([H1], None, [[1, 2], [2, 3], [3, 4], [4, 5]], 4, medium="GPU")], 0]),
    ("array_empty", "array", "a batch with no events and no dp rank",
     [0.5, []]),
    ("signed_hashes", None, "signed 64-bit hashes (LMCache, SGLang) and parent 0",
     [5.0, [["BlockStored", [-484813614762822561, 2537579355801541128], 0,
             [1196, 9733, 429, 1207, 16948, 18, 374, 279], 8, None, "GPU"],
            ["BlockRemoved", [-1, -9223372036854775808]]], 0]),
    ("str_hashes", None, "hashes as msgpack str instead of bin",
     [6.0, [stored_map(["abc", "\u00e9t\u00e9"], "p", toks(9, 2), 1)], 0]),
    ("map_tag_last_unknown_fields", None,
     "tag after the fields, fields from newer engines, an unknown event type",
     [7.0, [
         {"locality": "local", "block_hashes": [H1], "parent_block_hash": None,
          "token_ids": toks(10, 4), "block_size": 4, "lora_id": None, "medium": "GPU",
          "lora_name": None, "event_version": 1, "block_offsets": [0],
          "type": "BlockStored"},
         {"type": "CacheStoreCommitted", "block_hashes": "not-a-list", "transfer_id": 9},
         {"remaining_copy_counts": [0, 1], "type": "BlockRemoved", "block_hashes": [H1, H2],
          "medium": "GPU"},
     ], 0]),
    ("batch_as_map", None, "the batch itself as a map with named fields",
     {"ts": 8.0, "events": [stored_map([H2], None, toks(11, 4), 4)],
      "data_parallel_rank": 2}),
    ("array_extras", None,
     "extra batch and event elements; a metadata map where lora_name sits (SGLang)",
     [9.0, [["BlockStored", [H3], None, toks(12, 4), 4, None, "GPU",
             {"cache_salt": "tenant-a"}, None, None, None, None, "future", 1],
            ["BlockRemoved", [H3], "GPU", None, "future"],
            ["AllBlocksCleared", "future"],
            ["SomethingNew", 1, 2]], 0, "future-batch-field"]),
    ("ts_float32_dp_nil", None, "float32 timestamp and a nil dp rank",
     None),  # packed by hand below
    ("ts_int", None, "integer timestamp",
     [1700000000, [["AllBlocksCleared"]], 0]),
]


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    vdir = os.path.join(OUT, "vectors")
    cdir = os.path.join(OUT, "captures")
    os.makedirs(vdir, exist_ok=True)
    os.makedirs(cdir, exist_ok=True)
    for name, canonical, source, obj in VECTORS:
        if name == "ts_float32_dp_nil":
            data = (b"\x93\xca" + __import__("struct").pack(">f", 1.5) +
                    pack([["AllBlocksCleared"]]) + b"\xc0")
        else:
            data = pack(obj)
        back = msgpack.unpackb(data, raw=False, strict_map_key=False)
        write(os.path.join(vdir, name + ".msgpack"), data)
        write_json(os.path.join(vdir, name + ".json"),
                   {"source": source, "canonical": canonical, "batch": normalize(back)})

    # Capture 1: the raw bytes of a vLLM KV event batch (tagged-array events) as printed by a
    # pyzmq SUB in a public shell script next to a Dynamo + vLLM (KVBM) launch; see
    # captures/README.md.
    raw = (b'\x93\xcbA\xdaW\x1cfs\x8eQ\x91\x97\xabBlockStored\x91\xcf\xf3_\xe1{\r\x81\xa2L'
           b'\xcf\xda2\x9f\xe1\xbf\x8a\xac\x01\xdc\x00\x10\xcd\x10y\xcd\x01;\xcd\x02\xa6\xcd'
           b'\x03r\xce\x00\x02P]\xcc\xc6\xce\x00\x02P\\\xce\x00\x01-#\xcc\xc6\xce\x00\x02Ps'
           b'\xcc\xc6\xcd~9\x0b\xcd\x03\x05\xcd\x01f\xcd\x04\xa0\x10\xc0\xa3GPU\x00')
    write(os.path.join(cdir, "vllm_array_dynamo_kvbm.msgpack"), raw)
    write_json(os.path.join(cdir, "vllm_array_dynamo_kvbm.json"),
               {"source": "raw frame bytes, see README.md", "canonical": "array",
                "batch": normalize(msgpack.unpackb(raw, raw=False))})

    # Capture 2: vLLM 0.26.0 (map-encoded events), printed as a Python object in
    # volcano-sh/kthena issue #1535; re-packed here in msgspec's field order.
    obj = [1789095808.8378847, [{
        "type": "BlockStored", "block_hashes": [15760518052499183552],
        "parent_block_hash": None,
        "token_ids": [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198,
                      151644, 77091, 198, 151667],
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}], 0]
    data = pack(obj)
    write(os.path.join(cdir, "vllm_0.26_map_kthena_1535.msgpack"), data)
    write_json(os.path.join(cdir, "vllm_0.26_map_kthena_1535.json"),
               {"source": "volcano-sh/kthena#1535, re-packed", "canonical": "map",
                "batch": normalize(msgpack.unpackb(data, raw=False))})
    print("wrote %d vectors and 2 captures under %s" % (len(VECTORS), OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
