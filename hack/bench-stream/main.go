// Command bench-stream measures what a proxy adds to each streamed chunk: the time from an
// engine writing an SSE chunk to a client reading it, straight from the engine and through
// each proxy, in alternating rounds. hack/bench-stream.sh runs it against nginx and kvrelay.
//
//	bench-stream -serve 127.0.0.1:9000                     # the engine
//	bench-stream -target direct=http://127.0.0.1:9000 \
//	             -target kvrelay=http://127.0.0.1:9001 ...  # the client
//
// The engine answers POST /v1/chat/completions with a stream of -chunks chat completion
// chunks, one every -gap, each carrying its write time ("t", Unix nanoseconds); engine and
// client run on one machine, so the clocks agree. The client runs -streams concurrent
// streams per target per round, -rounds rounds, the target order rotating between rounds,
// and prints per target the median across rounds of each round's p50, p90 and p99 chunk
// latency, and the median of what each target adds over the first (direct) in the same
// round.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvrelay/kvrelay/internal/ssestamp"
)

type targets []target

type target struct{ name, url string }

func (t *targets) String() string { return fmt.Sprint(*t) }

func (t *targets) Set(v string) error {
	name, url, ok := strings.Cut(v, "=")
	if !ok || name == "" || url == "" {
		return errors.New("want NAME=URL")
	}
	*t = append(*t, target{name, strings.TrimRight(url, "/")})
	return nil
}

func main() {
	serve := flag.String("serve", "", "run the engine on this address instead of the client")
	chunks := flag.Int("chunks", 100, "chunks per stream")
	gap := flag.Duration("gap", time.Millisecond, "time between chunks")
	var ts targets
	flag.Var(&ts, "target", "NAME=URL to stream through (repeatable; the first is the reference)")
	rounds := flag.Int("rounds", 5, "rounds")
	requests := flag.Int("requests", 20, "streams per target per round")
	streams := flag.Int("streams", 4, "concurrent streams")
	flag.Parse()
	if *serve != "" {
		if err := engine(*serve, *chunks, *gap); err != nil {
			log.Fatal(err)
		}
		return
	}
	if len(ts) < 2 {
		log.Fatal("want at least two -target NAME=URL, the first the engine itself")
	}
	run(ts, *rounds, *requests, *streams)
}

func engine(addr string, chunks int, gap time.Duration) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: ssestamp.Handler(chunks, gap)}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() { <-ctx.Done(); _ = srv.Close() }()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

const body = `{"model":"` + ssestamp.Model + `","messages":[{"role":"user","content":"stream"}],"stream":true}`

// stream runs one request and appends each chunk's latency in nanoseconds.
func stream(client *http.Client, url string, lat []int64) ([]int64, error) {
	resp, err := client.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		return lat, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return lat, fmt.Errorf("status %d", resp.StatusCode)
	}
	return ssestamp.Read(resp.Body, lat)
}

type stats struct{ p50, p90, p99 float64 } // microseconds

func pct(sorted []int64, p float64) float64 {
	return float64(sorted[min(len(sorted)-1, int(float64(len(sorted))*p))]) / 1e3
}

func round(client *http.Client, url string, requests, streams int) (stats, error) {
	var mu sync.Mutex
	var all []int64
	var firstErr error
	next := make(chan struct{}, requests)
	for range requests {
		next <- struct{}{}
	}
	close(next)
	var wg sync.WaitGroup
	for range streams {
		wg.Go(func() {
			var lat []int64
			for range next {
				var err error
				if lat, err = stream(client, url, lat); err != nil {
					mu.Lock()
					firstErr = cmp(firstErr, err)
					mu.Unlock()
					return
				}
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if firstErr != nil {
		return stats{}, firstErr
	}
	if len(all) == 0 {
		return stats{}, errors.New("no chunks")
	}
	slices.Sort(all)
	return stats{pct(all, .50), pct(all, .90), pct(all, .99)}, nil
}

func cmp(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func run(ts targets, rounds, requests, streams int) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: streams}}
	res := make([][]stats, len(ts)) // [target][round]
	for r := range rounds {
		line := fmt.Sprintf("round %d/%d:", r+1, rounds)
		for i := range ts {
			k := (i + r) % len(ts)
			s, err := round(client, ts[k].url, requests, streams)
			if err != nil {
				log.Fatalf("%s: %v", ts[k].name, err)
			}
			res[k] = append(res[k], s)
			line += fmt.Sprintf(" %s p50=%.0fus p99=%.0fus", ts[k].name, s.p50, s.p99)
		}
		fmt.Fprintln(os.Stderr, line)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "target\tp50 us\tp90 us\tp99 us\tadded p50 us\tadded p99 us\t\n")
	for k, t := range ts {
		var p50, p90, p99, a50, a99 []float64
		for r, s := range res[k] {
			p50, p90, p99 = append(p50, s.p50), append(p90, s.p90), append(p99, s.p99)
			a50, a99 = append(a50, s.p50-res[0][r].p50), append(a99, s.p99-res[0][r].p99)
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f\t%+.0f\t%+.0f\t\n", t.name, median(p50), median(p90), median(p99), median(a50), median(a99))
	}
	_ = tw.Flush()
}
