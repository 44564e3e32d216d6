package ssestamp

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestHandlerStreamsStampedChunksThatReadMeasures(t *testing.T) {
	srv := httptest.NewServer(Handler(5, time.Millisecond))
	defer srv.Close()
	resp, err := srv.Client().Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lat, err := Read(resp.Body, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 5 {
		t.Fatalf("%d latencies, want 5", len(lat))
	}
	for _, l := range lat {
		if l < 0 || l > int64(5*time.Second) {
			t.Fatalf("implausible latency %d ns", l)
		}
	}
}

func TestReadRejectsBrokenStreams(t *testing.T) {
	if _, err := Read(strings.NewReader("data: {\"t\":12}\n\n"), nil); err == nil {
		t.Fatal("a stream without [DONE] was accepted")
	}
	if _, err := Read(strings.NewReader("data: {\"t\":x}\n\ndata: [DONE]\n\n"), nil); err == nil {
		t.Fatal("a malformed stamp was accepted")
	}
}

func FuzzRead(f *testing.F) {
	f.Add("data: {\"t\":12}\n\ndata: [DONE]\n\n")
	f.Add("data: {\"t\":}\n")
	f.Fuzz(func(t *testing.T, s string) {
		lat, err := Read(strings.NewReader(s), nil)
		if err == nil && !strings.Contains(s, "data: [DONE]") {
			t.Fatalf("accepted a stream without [DONE]: %q", s)
		}
		_ = lat
	})
}
