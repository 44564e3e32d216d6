package kvevents

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// TestReplayRefusesMalformedFrames: a replay answer that is neither [seq, payload] nor
// [topic, seq, payload] after the delimiter, or whose seq is not 8 bytes, ends the replay
// with an error wrapping ErrMalformed, keeping the batches before it.
func TestReplayRefusesMalformedFrames(t *testing.T) {
	good := AppendBatch(nil, &Batch{TS: 1, Events: []Event{{Kind: AllBlocksCleared}}}, FormatMap)
	seq := func(n uint64) []byte { return []byte{0, 0, 0, 0, 0, 0, 0, byte(n)} }
	for name, bad := range map[string][][]byte{
		"four frames":     {[]byte("topic"), []byte("extra"), seq(2), good},
		"short seq":       {[]byte("topic"), []byte{1, 2, 3}, good},
		"one frame":       {seq(2)},
		"seq, no payload": {[]byte("topic"), seq(2)},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			router := zmq4.NewRouter(ctx, zmq4.WithLogger(log.New(io.Discard, "", 0)))
			defer router.Close()
			if err := router.Listen("tcp://127.0.0.1:0"); err != nil {
				t.Fatal(err)
			}
			ep := "tcp://" + router.Addr().(*net.TCPAddr).String()
			go func() {
				req, err := router.Recv()
				if err != nil {
					return
				}
				id := req.Frames[0]
				_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte("topic"), seq(1), good))
				_ = router.Send(zmq4.NewMsgFrom(append([][]byte{id, {}}, bad...)...))
			}()
			got, err := Replay(ctx, ep, 0)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Replay: %v, want ErrMalformed", err)
			}
			if len(got) != 1 || got[0].Seq != 1 || got[0].Topic != "topic" {
				t.Fatalf("kept %+v, want the one good batch before the bad answer", got)
			}
		})
	}
}
