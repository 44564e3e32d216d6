package proxy_test

import (
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/internal/cputime"
	"github.com/kvrelay/kvrelay/internal/ssestamp"
)

// sseEngine serves ssestamp's stamped stream: chunks chunks, one every gap.
func sseEngine(b *testing.B, chunks int, gap time.Duration) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &http.Server{Handler: ssestamp.Handler(chunks, gap)}
	go srv.Serve(ln)
	b.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// BenchmarkSSEChunkLatency measures how long each streamed chunk takes from the engine's
// write to the client's read, straight from the engine and through the proxy, and reports the
// p50 and p99 in µs. The difference between the two is what the proxy adds per chunk.
func BenchmarkSSEChunkLatency(b *testing.B) {
	engine := sseEngine(b, 100, time.Millisecond)
	// One event loop: the engine and the client run in this process too, and a loop waiting
	// in epoll_wait holds its P, so with a loop per P they would wait for sysmon to take one
	// back (up to 10 ms) and the figures would be the Go scheduler's, not the proxy's.
	p := startProxy(b, []string{engine}, func(c *proxy.Config) { c.EventLoops = 1 })
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"stream"}],"stream":true}`
	for _, target := range []struct{ name, url string }{{"direct", engine}, {"proxy", "http://" + p.Addr()}} {
		b.Run(target.name, func(b *testing.B) {
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
			var lat []int64
			for b.Loop() {
				resp, err := client.Post(target.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				lat, err = ssestamp.Read(resp.Body, lat)
				if err != nil {
					b.Fatal(err)
				}
				resp.Body.Close()
			}
			slices.Sort(lat)
			if len(lat) > 0 {
				b.ReportMetric(float64(lat[len(lat)/2])/1e3, "p50-µs")
				b.ReportMetric(float64(lat[len(lat)*99/100])/1e3, "p99-µs")
			}
		})
	}
}

// BenchmarkTrickledHead: the proxy's CPU time (user + system of this process; the client is
// another process, python3) for a request head of 60 KiB that arrives a byte at a time, each
// byte its own TCP segment and read. Reported as cpu-ms/head.
func BenchmarkTrickledHead(b *testing.B) {
	py, err := exec.LookPath("python3")
	if err != nil {
		b.Skip("no python3 for the trickling client")
	}
	p := startProxy(b, []string{"http://127.0.0.1:1"}, func(cfg *proxy.Config) {
		cfg.MaxHeaderBytes, cfg.ReadTimeout = 64<<10, 5*time.Minute
	})
	const client = `
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (60 << 10) + b"\r\nContent-Length: 0\r\n\r\n"
for i in range(len(head)):
    s.send(head[i:i+1])
    time.sleep(0.00002)
s.settimeout(30)
s.recv(1)
`
	_, port, _ := net.SplitHostPort(p.Addr())
	var cpu time.Duration
	for b.Loop() {
		before := cputime.Self()
		if out, err := exec.Command(py, "-c", client, port).CombinedOutput(); err != nil {
			b.Fatalf("client: %v %s", err, out)
		}
		cpu += cputime.Self() - before
	}
	b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms/head")
}
