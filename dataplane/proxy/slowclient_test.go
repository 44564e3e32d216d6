package proxy_test

import (
	"bufio"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// bigStream is an engine that streams n SSE events of size bytes as fast as it can.
func bigStream(t *testing.T, n, size int) string {
	t.Helper()
	payload := strings.Repeat("x", size)
	return fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
		bw := bufio.NewWriterSize(conn, 64<<10)
		io.WriteString(bw, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		for i := range n {
			ev := fmt.Sprintf(`data: {"choices":[{"index":0,"delta":{"content":"%d %s"}}]}`+"\n\n", i, payload)
			fmt.Fprintf(bw, "%x\r\n%s\r\n", len(ev), ev)
		}
		io.WriteString(bw, "0\r\n\r\n")
		bw.Flush()
	})
}

// TestSlowClientPausesAndResumes: a client that reads slowly gets every byte of a stream
// larger than all the socket buffers between it and the engine; the proxy pauses forwarding
// instead of buffering without bound.
func TestSlowClientPausesAndResumes(t *testing.T) {
	const n, size = 4000, 4000 // ~16 MB
	url := bigStream(t, n, size)
	p := startProxy(t, []string{url}, func(cfg *proxy.Config) { cfg.MaxBufferedResponse = 32 << 20 })
	resp, err := http.Post("http://"+p.Addr()+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 1, true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	time.Sleep(300 * time.Millisecond) // let the engine get far ahead
	h := sha256.New()
	buf := make([]byte, 256<<10)
	total := 0
	for {
		k, err := resp.Body.Read(buf)
		h.Write(buf[:k])
		total += k
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("after %d bytes: %v", total, err)
		}
		time.Sleep(time.Millisecond) // a slow reader
	}
	want := 0
	for i := range n {
		want += len(fmt.Sprintf(`data: {"choices":[{"index":0,"delta":{"content":"%d %s"}}]}`+"\n\n", i, strings.Repeat("x", size)))
	}
	if total != want {
		t.Fatalf("client got %d bytes, the engine sent %d", total, want)
	}
}

// TestStalledClientIsCutOff: a client that stops reading altogether is cut off once the
// bytes held for it pass MaxBufferedResponse, and the abort is counted.
func TestStalledClientIsCutOff(t *testing.T) {
	url := bigStream(t, 20000, 4000) // ~80 MB
	p := startProxy(t, []string{url}, func(cfg *proxy.Config) { cfg.MaxBufferedResponse = 1 << 20 })
	conn := streamWithoutReading(t, &net.Dialer{}, p.Addr())
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, m := get(t, "http://"+p.Addr()+"/metrics")
		if strings.Contains(m, `kvrelay_proxy_aborted_requests_total{reason="slow_client"} 1`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a client that never reads was not cut off")
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The connection was closed: reading drains what was buffered, then ends.
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, conn); err != nil {
		t.Fatalf("the cut-off connection did not end cleanly: %v", err)
	}
}

// TestSlowClientGetsAnswerAfterEngineCloses: an engine that sends a large answer and closes
// the connection at once (Connection: close) while the proxy holds forwarding back for a slow
// client: the client still gets every byte, for a Content-Length body and for one that ends
// at the close.
func TestSlowClientGetsAnswerAfterEngineCloses(t *testing.T) {
	const size = 8 << 20
	for _, tc := range []struct {
		name   string
		length bool
	}{{"content-length", true}, {"until-close", false}} {
		t.Run(tc.name, func(t *testing.T) {
			body := strings.Repeat("y", size)
			url := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
				head := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
				if tc.length {
					head += fmt.Sprintf("Content-Length: %d\r\n", size)
				}
				io.WriteString(conn, head+"\r\n"+body)
				conn.Close()
			})
			p := startProxy(t, []string{url}, func(cfg *proxy.Config) { cfg.MaxBufferedResponse = 32 << 20 })
			resp, err := http.Post("http://"+p.Addr()+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 1, false)))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			time.Sleep(300 * time.Millisecond) // the engine has sent everything and closed
			buf := make([]byte, 64<<10)
			total := 0
			for {
				k, err := resp.Body.Read(buf)
				total += k
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatalf("after %d bytes: %v", total, err)
				}
				time.Sleep(200 * time.Microsecond) // a slow reader
			}
			if total != size {
				t.Fatalf("client got %d bytes, the engine sent %d", total, size)
			}
		})
	}
}

// TestNeverReadingClientFreesTheEngine: a client that stops reading a slow, endless stream
// (a real engine's tokens: too few bytes to pass MaxBufferedResponse soon) is cut off after
// the stall timeout, and the engine's connection is closed, which cancels its request.
//
// The proxy pauses the stream once the socket buffers towards the client are full (some
// megabytes: about 2 s of this stream) and cuts it off ClientStallTimeout later. The engine
// keeps its pace of 2 MB/s by the clock, an event every 2 ms caught up after an overslept
// one, so that a loaded machine waking its loop late does not stretch the filling; and the
// test gives it 20 s, where it allowed 5 s and a loaded machine took longer.
func TestNeverReadingClientFreesTheEngine(t *testing.T) {
	url, engineGone := endlessStream(t, 4000, 2*time.Millisecond)
	p := startProxy(t, []string{url}, func(cfg *proxy.Config) {
		cfg.MaxBufferedResponse = 64 << 20
		cfg.ClientStallTimeout = 300 * time.Millisecond
	})
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	streamWithoutReading(t, &d, p.Addr())
	select {
	case <-engineGone:
	case <-time.After(20 * time.Second):
		t.Fatal("the engine still streams to a client that stopped reading 20 s ago")
	}
	if _, m := get(t, "http://"+p.Addr()+"/metrics"); !strings.Contains(m, `kvrelay_proxy_aborted_requests_total{reason="slow_client"} 1`) {
		t.Error("the cut-off was not counted as slow_client")
	}
}

// TestStallCountsFromTheLastByteTheClientTook: a client that stops reading, with the
// kernel's default socket buffers, is cut off about the stall timeout after its receive
// window closes, not once the megabytes of the proxy's send buffer towards it have filled
// behind it (at this stream's 200 KB/s, half a minute).
func TestStallCountsFromTheLastByteTheClientTook(t *testing.T) {
	url, engineGone := endlessStream(t, 2000, 10*time.Millisecond)
	p := startProxy(t, []string{url}, func(cfg *proxy.Config) {
		cfg.MaxBufferedResponse = 64 << 20
		cfg.ClientStallTimeout = 500 * time.Millisecond
	})
	streamWithoutReading(t, &net.Dialer{}, p.Addr())
	start := time.Now()
	select {
	case <-engineGone:
		t.Logf("cut off %v after the request", time.Since(start).Round(10*time.Millisecond))
	case <-time.After(15 * time.Second):
		t.Fatal("the engine still streams to a client that stopped reading 15 s ago")
	}
	if _, m := get(t, "http://"+p.Addr()+"/metrics"); !strings.Contains(m, `kvrelay_proxy_aborted_requests_total{reason="slow_client"} 1`) {
		t.Error("the cut-off was not counted as slow_client")
	}
}

// endlessStream is an engine that streams an event of about size bytes every period, by the
// clock (an event overslept is caught up, so that a loaded machine does not slow the pace),
// until its connection fails; gone closes then.
func endlessStream(t *testing.T, size int, period time.Duration) (url string, gone <-chan struct{}) {
	done := make(chan struct{})
	payload := strings.Repeat("y", size)
	url = fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		start := time.Now()
		for i := 0; ; i++ {
			ev := fmt.Sprintf(`data: {"choices":[{"index":0,"delta":{"content":"%d %s"}}]}`+"\n\n", i, payload)
			conn.SetWriteDeadline(time.Now().Add(30 * time.Second))
			if _, err := fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev); err != nil {
				close(done)
				return
			}
			time.Sleep(time.Until(start.Add(time.Duration(i+1) * period)))
		}
	})
	return url, done
}

// streamWithoutReading sends a streamed chat completion to the proxy at addr on a connection
// of d and returns the connection, whose answer it does not read; it closes when the test
// ends.
func streamWithoutReading(t *testing.T, d *net.Dialer, addr string) net.Conn {
	t.Helper()
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	body := chatBody("s", "u", 1, true)
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return conn
}
