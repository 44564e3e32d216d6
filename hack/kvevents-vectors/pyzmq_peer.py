#!/usr/bin/python3
"""A libzmq peer (Debian's python3-zmq + python3-msgpack) for kvrelay's KV event interop
tests (engines/kvevents/pyzmq_test.go). Each mode does one thing and reports on stdout, one
JSON document per line, so that the Go test can compare with what it sent or received.

    sub ENDPOINT TOPIC N          SUB dials ENDPOINT, prints N messages as
                                  {"topic", "seq", "batch"} (batch in normalize() form)
    pub bind|connect ENDPOINT TOPIC FILE...
                                  XPUB binds (printing {"endpoint"}) or dials ENDPOINT, waits
                                  for a subscription, then sends each FILE's bytes as
                                  [TOPIC, seq, payload] with seq 0, 1, ...; prints {"sent": n}
    replay ENDPOINT FROM          DEALER asks the ROUTER at ENDPOINT for batches from FROM,
                                  prints {"seq", "batch"} per answer and {"end": true}
    replay-req ENDPOINT FROM      same from a REQ socket (vLLM's example subscriber); prints
                                  the first answer only: {"frames": n, "seq": s}
    router FILE...                ROUTER binds a free port (printing {"endpoint"}) and answers
                                  one replay request the way vLLM's ZmqEventPublisher does,
                                  from a buffer holding FILE i at seq 10+i; prints {"served"}
    normalize FILE...             prints normalize() of each FILE (bytes kvrelay encoded)
"""

import json
import os
import sys

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen import normalize  # noqa: E402

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_MS = 15000


def out(obj):
    print(json.dumps(obj), flush=True)


def unpack(data):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    ctx = zmq.Context()
    if mode == "sub":
        endpoint, topic, n = args[0], args[1], int(args[2])
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        s.setsockopt_string(zmq.SUBSCRIBE, topic)
        s.connect(endpoint)
        for _ in range(n):
            t, seq, payload = s.recv_multipart()
            out({"topic": t.decode(), "seq": int.from_bytes(seq, "big"),
                 "batch": normalize(unpack(payload))})
    elif mode == "pub":
        how, endpoint, topic, files = args[0], args[1], args[2], args[3:]
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        if how == "bind":
            port = s.bind_to_random_port("tcp://127.0.0.1")
            out({"endpoint": "tcp://127.0.0.1:%d" % port})
        else:
            s.connect(endpoint)
        sub = s.recv()  # b"\x01" + topic once a subscriber has subscribed
        assert sub[:1] == b"\x01", sub
        for i, f in enumerate(files):
            with open(f, "rb") as fh:
                s.send_multipart([topic.encode(), i.to_bytes(8, "big"), fh.read()])
        out({"sent": len(files)})
    elif mode == "replay":
        endpoint, start = args[0], int(args[1])
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        s.connect(endpoint)
        s.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            # vLLM since mid-2026: ["", topic, seq, payload]; before: ["", seq, payload].
            frames = s.recv_multipart()
            assert len(frames) in (3, 4) and frames[0] == b"", frames
            topic = frames[1].decode() if len(frames) == 4 else None
            seq, payload = frames[-2], frames[-1]
            if seq == END_SEQ:
                assert payload == b"", frames
                out({"end": True, "topic": topic})
                break
            out({"seq": int.from_bytes(seq, "big"), "topic": topic,
                 "batch": normalize(unpack(payload))})
    elif mode == "replay-req":
        endpoint, start = args[0], int(args[1])
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        s.connect(endpoint)
        s.send(start.to_bytes(8, "big"))
        frames = s.recv_multipart()
        out({"frames": len(frames), "seq": int.from_bytes(frames[-2], "big", signed=True)})
    elif mode in ("router", "router-topic"):
        # router-topic answers as vLLM's ZmqEventPublisher does since mid-2026, with the
        # topic frame; router as it did before.
        topic = b"kv@10.0.0.7:8000@Qwen/Qwen3-8B" if mode == "router-topic" else None
        buf = []
        for i, f in enumerate(args):
            with open(f, "rb") as fh:
                buf.append((10 + i, fh.read()))
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        out({"endpoint": "tcp://127.0.0.1:%d" % port})
        # vLLM's ZmqEventPublisher._service_replay, one request.
        frame = s.recv_multipart()
        assert len(frame) == 3, frame
        client_id, _, start_seq_bytes = frame
        start_seq = int.from_bytes(start_seq_bytes, "big")
        for seq, payload in buf:
            if seq >= start_seq:
                if topic is None:
                    s.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
                else:
                    s.send_multipart((client_id, b"", topic, seq.to_bytes(8, "big"), payload))
        if topic is None:
            s.send_multipart((client_id, b"", END_SEQ, b""))
        else:
            s.send_multipart((client_id, b"", b"", END_SEQ, b""))
        out({"served": start_seq})
    elif mode == "normalize":
        for f in args:
            with open(f, "rb") as fh:
                out(normalize(unpack(fh.read())))
    else:
        raise SystemExit("unknown mode " + mode)
    ctx.destroy(linger=5000)  # flush what was sent, then close every socket


if __name__ == "__main__":
    main()
