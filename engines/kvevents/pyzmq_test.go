package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// The tests in this file check interoperability with libzmq and an independent msgpack
// implementation through Debian's python3-zmq and python3-msgpack, driving
// hack/kvevents-vectors/pyzmq_peer.py. They skip when those packages are missing:
//
//	apt-get install -y python3-zmq python3-msgpack

const python = "/usr/bin/python3"

var peerScript = filepath.Join("..", "..", "hack", "kvevents-vectors", "pyzmq_peer.py")

func needPyzmq(t *testing.T) {
	t.Helper()
	if err := exec.Command(python, "-c", "import zmq, msgpack").Run(); err != nil {
		t.Skipf("python3-zmq/python3-msgpack unavailable (%v); apt-get install -y python3-zmq python3-msgpack", err)
	}
}

// peer is one run of pyzmq_peer.py; next returns its stdout lines one at a time.
type peer struct {
	t      *testing.T
	cmd    *exec.Cmd
	lines  chan string
	stderr bytes.Buffer
}

func startPeer(t *testing.T, ctx context.Context, args ...string) *peer {
	t.Helper()
	p := &peer{t: t, lines: make(chan string, 64)}
	p.cmd = exec.CommandContext(ctx, python, append([]string{peerScript}, args...)...)
	p.cmd.Stderr = &p.stderr
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { // owned by the peer; ends when the process closes stdout
		defer close(p.lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	})
	return p
}

// next decodes the peer's next line into v.
func (p *peer) next(v any) {
	p.t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			_ = p.cmd.Wait()
			p.t.Fatalf("peer ended early: %s", p.stderr.String())
		}
		if err := json.Unmarshal([]byte(line), v); err != nil {
			p.t.Fatalf("peer line %q: %v", line, err)
		}
	case <-time.After(20 * time.Second):
		p.t.Fatalf("peer silent; stderr: %s", p.stderr.String())
	}
}

// wait waits for the peer to exit cleanly.
func (p *peer) wait() {
	p.t.Helper()
	for range p.lines {
	}
	if err := p.cmd.Wait(); err != nil {
		p.t.Fatalf("peer: %v: %s", err, p.stderr.String())
	}
}

func vectorFiles(t *testing.T) ([]string, []any) {
	t.Helper()
	vs := loadVectors(t, "vectors")
	var files []string
	var want []any
	for _, v := range vs {
		files = append(files, filepath.Join("testdata", "vectors", v.name+".msgpack"))
		want = append(want, v.want)
	}
	return files, want
}

func interopBatch(i int) *Batch {
	b := testBatch(i)
	b.Events = append(b.Events,
		Event{Kind: BlockStored, BlockHashes: []Hash{HashBytes([]byte{0xff, byte(i), 0}), HashU64(15760518052499183552)},
			TokenIDs: []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315}, BlockSize: 4,
			Medium: "GPU", ExtraKeys: []RawValue{nil, nil}, HasExtraKeys: true, GroupIdx: 1, HasGroupIdx: true,
			KVCacheSpecKind: "sliding_window", SlidingWindow: 128, HasSlidingWindow: true},
		Event{Kind: AllBlocksCleared})
	b.DPRank, b.HasDPRank = 2, true
	return b
}

func TestPyzmqGoPublisherLibzmqSubscriber(t *testing.T) {
	needPyzmq(t)
	for _, f := range []Format{FormatMap, FormatArray} {
		t.Run(f.String(), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pub := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Topic: "kv-events", Format: f})
			const n = 5
			py := startPeer(t, ctx, "sub", pub.Endpoint(), "kv-events", fmt.Sprint(n))
			waitFor(t, ctx, "libzmq's subscription", pub.HasSubscribers)
			for i := range n {
				b := interopBatch(i)
				if err := pub.Publish(b); err != nil {
					t.Fatal(err)
				}
				var got struct {
					Topic string `json:"topic"`
					Seq   uint64 `json:"seq"`
					Batch any    `json:"batch"`
				}
				py.next(&got)
				if got.Topic != "kv-events" || got.Seq != uint64(i) {
					t.Fatalf("message %d: topic %q seq %d", i, got.Topic, got.Seq)
				}
				if want := canonical(t, b); !reflect.DeepEqual(got.Batch, want) {
					t.Fatalf("python decoded\n%v\nwant\n%v", got.Batch, want)
				}
			}
			py.wait()
		})
	}
}

func TestPyzmqLibzmqPublisherGoSubscriber(t *testing.T) {
	needPyzmq(t)
	files, want := vectorFiles(t)
	tests := []struct {
		name string
		bind bool // the Go subscriber binds and libzmq connects out
	}{
		{"libzmq binds, go dials", false},
		{"go binds, libzmq connects", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			rec := &recorder{t: t}
			var py *peer
			var sub *Subscriber
			var err error
			if tc.bind {
				sub, err = NewSubscriber(SubscriberConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, Topic: "kv"})
				if err != nil {
					t.Fatal(err)
				}
				stop := runSubscriber(t, ctx, sub, rec)
				defer stop()
				<-sub.Ready()
				py = startPeer(t, ctx, append([]string{"pub", "connect", sub.Endpoint(), "kv-events"}, files...)...)
			} else {
				py = startPeer(t, ctx, append([]string{"pub", "bind", "-", "kv-events"}, files...)...)
				var ep struct {
					Endpoint string `json:"endpoint"`
				}
				py.next(&ep)
				sub, err = NewSubscriber(SubscriberConfig{Endpoint: ep.Endpoint, Topic: "kv"})
				if err != nil {
					t.Fatal(err)
				}
				stop := runSubscriber(t, ctx, sub, rec)
				defer stop()
			}
			var sent struct {
				Sent int `json:"sent"`
			}
			py.next(&sent)
			waitFor(t, ctx, "every vector", func() bool { return rec.len() == len(files) })
			py.wait()
			rec.mu.Lock()
			defer rec.mu.Unlock()
			for i := range files {
				if rec.seqs[i] != uint64(i) {
					t.Fatalf("seqs %v", rec.seqs)
				}
				if !reflect.DeepEqual(rec.batches[i], want[i]) {
					t.Fatalf("%s\n got %v\nwant %v", files[i], rec.batches[i], want[i])
				}
			}
			if st := sub.Stats(); st.Malformed != 0 || st.Gaps != 0 {
				t.Fatalf("stats %v", st)
			}
		})
	}
}

func TestPyzmqReplay(t *testing.T) {
	needPyzmq(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	t.Run("libzmq DEALER and REQ against the go ROUTER", func(t *testing.T) {
		pub := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv@sim"})
		var want []any
		for i := range 6 {
			b := interopBatch(i)
			if err := pub.Publish(b); err != nil {
				t.Fatal(err)
			}
			want = append(want, canonical(t, b))
		}
		waitFor(t, ctx, "the sender", func() bool { return pub.Stats().Sent == 6 })

		py := startPeer(t, ctx, "replay", pub.ReplayEndpoint(), "2")
		for seq := 2; seq < 6; seq++ {
			var got struct {
				Seq   int     `json:"seq"`
				Topic *string `json:"topic"`
				Batch any     `json:"batch"`
			}
			py.next(&got)
			if got.Seq != seq || !reflect.DeepEqual(got.Batch, want[seq]) {
				t.Fatalf("replayed %d: %v\nwant %d: %v", got.Seq, got.Batch, seq, want[seq])
			}
			if got.Topic == nil || *got.Topic != "kv@sim" {
				t.Fatalf("replayed %d without the topic frame vLLM sends", got.Seq)
			}
		}
		var end struct {
			End bool `json:"end"`
		}
		py.next(&end)
		if !end.End {
			t.Fatal("no end of replay")
		}
		py.wait()

		// vLLM's example subscriber asks from a REQ socket, which takes only the first answer.
		req := startPeer(t, ctx, "replay-req", pub.ReplayEndpoint(), "4")
		var first struct {
			Frames int `json:"frames"`
			Seq    int `json:"seq"`
		}
		req.next(&first)
		if first.Frames != 3 || first.Seq != 4 {
			t.Fatalf("REQ got %+v", first)
		}
		req.wait()
	})

	for _, mode := range []string{"router", "router-topic"} {
		t.Run("go Replay against vLLM's ROUTER loop/"+mode, func(t *testing.T) { replayFromPython(t, ctx, mode) })
	}
}

// replayFromPython runs Replay against the python peer's ROUTER in mode (router: vLLM's replay
// before the topic frame; router-topic: after).
func replayFromPython(t *testing.T, ctx context.Context, mode string) {
	{
		files, want := vectorFiles(t)
		files, want = files[:4], want[:4]
		py := startPeer(t, ctx, append([]string{mode}, files...)...)
		var ep struct {
			Endpoint string `json:"endpoint"`
		}
		py.next(&ep)
		got, err := Replay(ctx, ep.Endpoint, 11)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 3 {
			t.Fatalf("%d batches", len(got))
		}
		for i, r := range got {
			if r.Seq != uint64(11+i) {
				t.Fatalf("seq %d at %d", r.Seq, i)
			}
			if c := canonical(t, &r.Batch); !reflect.DeepEqual(c, want[1+i]) {
				t.Fatalf("batch %d\n got %v\nwant %v", r.Seq, c, want[1+i])
			}
			if wantTopic := map[string]string{"router-topic": "kv@10.0.0.7:8000@Qwen/Qwen3-8B"}[mode]; r.Topic != wantTopic {
				t.Fatalf("batch %d topic %q, want %q", r.Seq, r.Topic, wantTopic)
			}
		}
		py.wait()
	}
}

// TestPyzmqDecodesAppendBatch has python3-msgpack read random batches kvrelay encoded, in
// both formats, and compares its reading with the batch.
func TestPyzmqDecodesAppendBatch(t *testing.T) {
	needPyzmq(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	var files []string
	var want []any
	for i := range 60 {
		seed := make([]byte, 64+rng.IntN(4000))
		for j := range seed {
			seed[j] = byte(rng.Uint32())
		}
		b := (&fuzzSource{b: seed}).batch()
		b.TS = float64(i) + 0.25 // JSON has no NaN
		f := []Format{FormatMap, FormatArray}[i%2]
		name := filepath.Join(dir, fmt.Sprintf("%02d-%s.msgpack", i, f))
		if err := os.WriteFile(name, AppendBatch(nil, b, f), 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, name)
		want = append(want, canonical(t, b))
	}
	py := startPeer(t, ctx, append([]string{"normalize"}, files...)...)
	for i := range files {
		var got any
		py.next(&got)
		if !reflect.DeepEqual(got, want[i]) {
			t.Fatalf("%s: python reads\n%v\nwant\n%v", strings.TrimPrefix(files[i], dir), got, want[i])
		}
	}
	py.wait()
}
