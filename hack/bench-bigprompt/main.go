// Command bench-bigprompt measures what very large prompts cost the other clients of one
// proxy: it starts a simulated engine and a proxy with one event loop (kvrelay binaries),
// sends chat requests with bodies of --body-mb megabytes from --senders clients for
// --duration, and meanwhile times GET /health on its own keep-alive connection every 10 ms.
// It prints /health latency (median, p99, max) while the bodies arrive, the answers' status
// codes and times, and the proxy's resident memory before, at its peak and --settle after
// (with the live Go heap then).
//
//	go build -o bin/kvrelay ./cmd/kvrelay && go run ./hack/bench-bigprompt --kvrelay bin/kvrelay
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	bin := flag.String("kvrelay", "bin/kvrelay", "kvrelay binary")
	bodyMB := flag.Int("body-mb", 30, "size of each large request body, MB")
	senders := flag.Int("senders", 3, "clients sending large bodies at once")
	duration := flag.Duration("duration", 20*time.Second, "how long the large bodies keep coming")
	settle := flag.Duration("settle", 10*time.Second, "idle time before the last memory reading")
	base := flag.Int("port", 23400, "first of the three loopback ports used")
	flag.Parse()

	simAddr := fmt.Sprintf("127.0.0.1:%d", *base)
	proxyAddr := fmt.Sprintf("127.0.0.1:%d", *base+1)
	adminAddr := fmt.Sprintf("127.0.0.1:%d", *base+2)
	sim := start(*bin, "sim", "--listen", simAddr, "--speedup-ratio", "50")
	defer stop(sim)
	waitHealth(simAddr)
	proxy := start(*bin, "proxy", "--listen", proxyAddr, "--upstream", "id=w0,url=http://"+simAddr,
		"--event-loops", "1", "--ebpf", "off", "--admin-listen", adminAddr, "--max-body-bytes", strconv.Itoa((*bodyMB+2)<<20))
	defer stop(proxy)
	waitHealth(proxyAddr)

	body := bigBody(*bodyMB << 20)
	rssBefore := rss(proxy.Process.Pid)
	var peak atomic.Int64
	peak.Store(rssBefore)
	done := make(chan struct{})
	go func() { // samples RSS
		for {
			select {
			case <-done:
				return
			case <-time.After(50 * time.Millisecond):
				if r := rss(proxy.Process.Pid); r > peak.Load() {
					peak.Store(r)
				}
			}
		}
	}()

	var mu sync.Mutex
	codes := map[int]int{}
	var answerTimes []time.Duration
	var wg sync.WaitGroup
	end := time.Now().Add(*duration)
	for range *senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 2 * time.Minute}
			for time.Now().Before(end) {
				t0 := time.Now()
				resp, err := c.Post("http://"+proxyAddr+"/v1/chat/completions", "application/json", bytes.NewReader(body))
				code := 0
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					code = resp.StatusCode
				}
				mu.Lock()
				codes[code]++
				answerTimes = append(answerTimes, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	health := probe(proxyAddr, end)
	wg.Wait()
	peakNow := peak.Load()
	time.Sleep(*settle)
	close(done)
	after := rss(proxy.Process.Pid)
	heap := heapInUse(adminAddr)

	slices.Sort(health)
	slices.Sort(answerTimes)
	fmt.Printf("body %d MB × %d senders for %s, one event loop\n", *bodyMB, *senders, *duration)
	fmt.Printf("/health while they arrive: n=%d p50 %s p99 %s max %s\n", len(health), q(health, 0.5), q(health, 0.99), q(health, 1))
	fmt.Printf("large requests: %v, answer time p50 %s max %s\n", codes, q(answerTimes, 0.5), q(answerTimes, 1))
	fmt.Printf("proxy RSS: before %d MB, peak %d MB, %s after %d MB (live Go heap then %d MB)\n", rssBefore>>20, peakNow>>20, *settle, after>>20, heap>>20)
}

// bigBody is a chat request whose one user message is n bytes of numbered words in lines.
func bigBody(n int) []byte {
	var sb strings.Builder
	for i := 0; sb.Len() < n; i++ {
		fmt.Fprintf(&sb, "word%d ", i)
		if i%16 == 15 {
			sb.WriteString("\n")
		}
	}
	b, _ := json.Marshal(map[string]any{"model": "gpt-oss-120b", "max_tokens": 1,
		"messages": []map[string]string{{"role": "user", "content": sb.String()}}})
	return b
}

// probe times GET /health on one keep-alive connection every 10 ms until end.
func probe(addr string, end time.Time) []time.Duration {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	var out []time.Duration
	for time.Now().Before(end) {
		t0 := time.Now()
		if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			log.Fatal(err)
		}
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			log.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		out = append(out, time.Since(t0))
		time.Sleep(10 * time.Millisecond)
	}
	return out
}

func q(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return d[min(len(d)-1, int(p*float64(len(d))))].Round(10 * time.Microsecond)
}

// heapInUse reads go_memstats_heap_inuse_bytes from the proxy's admin /metrics after a
// heap profile has made it collect garbage (an idle process collects only every 2 minutes).
func heapInUse(addr string) int64 {
	if resp, err := http.Get("http://" + addr + "/debug/pprof/heap?gc=1"); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_memstats_heap_inuse_bytes "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return int64(f)
		}
	}
	return 0
}

func rss(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func start(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
	if err := cmd.Start(); err != nil {
		log.Fatal(err)
	}
	return cmd
}

func stop(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	_, _ = cmd.Process.Wait()
}

func waitHealth(addr string) {
	for range 200 {
		if resp, err := http.Get("http://" + addr + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	log.Fatalf("%s not healthy", addr)
}
