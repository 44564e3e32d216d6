// Package ssestamp measures what a path adds to streamed chunks: an engine stand-in whose
// OpenAI chat completion chunks carry the time they were written ("t", Unix nanoseconds),
// and the reader that turns each chunk's arrival into a latency. Writer and reader must share
// a clock (one machine). It serves the SSE benchmarks of the proxy and hack/bench-stream.
package ssestamp

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"
)

// Model is the model the handler's chunks name and /v1/models lists.
const Model = "bench-model"

// Handler answers POST /v1/chat/completions with chunks stamped chunks one every gap, then
// [DONE]; GET /v1/models lists Model and GET /health answers 200.
func Handler(chunks int, gap time.Duration) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := range chunks {
			fmt.Fprintf(w, `data: {"id":"x","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,"delta":{"content":" tok%d"},"finish_reason":null}],"t":%d}`+"\n\n", Model, i, time.Now().UnixNano())
			fl.Flush()
			time.Sleep(gap)
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":"%s","object":"model","owned_by":"bench"}]}`, Model)
	})
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	return mux
}

// Read reads a stream from Handler to its end and appends each stamped chunk's latency, from
// its write to its arrival here, in nanoseconds. A stream that ends without [DONE] or carries
// a malformed stamp is an error.
func Read(body io.Reader, lat []int64) ([]int64, error) {
	sc := bufio.NewScanner(body)
	done := false
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.Equal(line, []byte("data: [DONE]")) {
			done = true
		}
		i := bytes.Index(line, []byte(`"t":`))
		if i < 0 {
			continue
		}
		now := time.Now().UnixNano()
		t, err := strconv.ParseInt(string(bytes.TrimRight(line[i+4:], "}")), 10, 64)
		if err != nil {
			return lat, fmt.Errorf("bad chunk %q", line)
		}
		lat = append(lat, now-t)
	}
	if err := sc.Err(); err != nil {
		return lat, err
	}
	if !done {
		return lat, errors.New("stream ended without [DONE]")
	}
	return lat, nil
}
