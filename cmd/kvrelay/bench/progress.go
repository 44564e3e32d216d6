package bench

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

// Progress reports a run as it goes: a redrawn bar on a terminal, a plain line every few
// seconds otherwise. A nil *Progress reports nothing. It is safe for concurrent use.
type Progress struct {
	w        io.Writer
	terminal bool
	label    string
	total    int

	mu     sync.Mutex
	sentN  int
	doneN  int
	errs   int
	ttft   []time.Duration // recent successful TTFTs, for the running p50
	stop   chan struct{}
	closed bool
	wg     sync.WaitGroup
}

// NewProgress starts reporting to w; total is the expected number of requests (0: unknown).
// Stop ends it.
func NewProgress(w io.Writer, label string, total int) *Progress {
	p := &Progress{w: w, label: label, total: total, stop: make(chan struct{})}
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			p.terminal = true
		}
	}
	every := 5 * time.Second
	if p.terminal {
		every = 250 * time.Millisecond
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
				p.draw(false)
			}
		}
	}()
	return p
}

func (p *Progress) sent() {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.sentN++
	p.mu.Unlock()
}

func (p *Progress) done(r *Record) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.doneN++
	if !r.OK() {
		p.errs++
	} else {
		p.ttft = append(p.ttft, r.TTFT)
		if len(p.ttft) > 512 {
			p.ttft = p.ttft[len(p.ttft)-256:]
		}
	}
	p.mu.Unlock()
}

// Stop draws the final state and ends reporting.
func (p *Progress) Stop() {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.mu.Unlock()
	close(p.stop)
	p.wg.Wait()
	p.draw(true)
}

func (p *Progress) draw(final bool) {
	p.mu.Lock()
	sent, done, errs := p.sentN, p.doneN, p.errs
	var p50 time.Duration
	if len(p.ttft) > 0 {
		s := slices.Clone(p.ttft)
		slices.Sort(s)
		p50 = s[len(s)/2]
	}
	p.mu.Unlock()
	total := "?"
	if p.total > 0 {
		total = fmt.Sprint(p.total)
	}
	line := fmt.Sprintf("%s sent %d/%s finished %d errors %d TTFT p50 %v", p.label, sent, total, done, errs, p50.Round(time.Millisecond))
	if p.terminal {
		bar := ""
		if p.total > 0 {
			n := min(30, 30*done/p.total)
			bar = "[" + strings.Repeat("#", n) + strings.Repeat(".", 30-n) + "] "
		}
		end := ""
		if final {
			end = "\n"
		}
		fmt.Fprintf(p.w, "\r\033[K%s%s%s", bar, line, end)
		return
	}
	fmt.Fprintln(p.w, line)
}
