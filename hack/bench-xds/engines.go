package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// engineSide is the W synthetic engines: in this process, or (the default) in a child
// process of this binary, so that the control plane's CPU is measured alone.
type engineSide struct {
	specs []registry.Worker
	ws    []*synthWorker // in process

	procs []*child // children, -engines-per-process workers each
	files []string // their records
}

// engineResult is what the engines published during the run.
type engineResult struct {
	Stored, Removed, Messages, Failed, Bytes uint64
	CPUSeconds, LoadSeconds                  float64
	Error                                    string
	recs                                     []pubRec
}

func synthParams(f flags) (batch int, sample int) {
	batch = f.batch
	if batch <= 0 {
		batch = 1
		if f.rate > 10000 {
			batch = 16
		}
	}
	sample = f.sample
	if sample < 0 {
		sample = 0
		if f.rate > 10000 {
			sample = 2
		}
	}
	return batch, sample
}

// modelOf is the model worker (or proxy) i serves: with -models N above 1, model i mod N.
func modelOf(f flags, i int) string {
	if f.models <= 1 {
		return model
	}
	return model + "-" + strconv.Itoa(i%f.models)
}

func newSynthWorkers(f flags, mask uint64) ([]*synthWorker, []registry.Worker, error) {
	var ws []*synthWorker
	var specs []registry.Worker
	for i := f.firstWorker; i < f.firstWorker+f.workers; i++ {
		w, err := newSynthWorker(i, modelOf(f, i), max(f.maxBlocks/f.workers, chainBlocks), mask)
		if err != nil {
			for _, w := range ws {
				w.close()
			}
			return nil, nil, err
		}
		ws = append(ws, w)
		specs = append(specs, registry.Worker{ID: w.id, URL: w.url, Model: modelOf(f, i), BlockSize: synthBlockSize, Engine: "sim", KVEvents: w.pub.Endpoint()})
	}
	return ws, specs, nil
}

func startEngines(f flags, dir string) (*engineSide, error) {
	batch, sample := synthParams(f)
	mask := uint64(1)<<uint(sample) - 1
	if f.inProcess {
		ws, specs, err := newSynthWorkers(f, mask)
		if err != nil {
			return nil, err
		}
		return &engineSide{ws: ws, specs: specs}, nil
	}
	// Each process publishes its workers' share of the rate and holds their share of the
	// blocks; batch and sample are the run's, not recomputed from a process's share.
	e := &engineSide{}
	per := max(f.enginesPer, 1)
	for first := 0; first < f.workers; first += per {
		n := min(per, f.workers-first)
		file := filepath.Join(dir, fmt.Sprintf("published-%d.bin", first))
		c, err := startChildMode(fmt.Sprintf("the engine process of workers %d-%d", first, first+n-1), "-mode", "engines",
			"-first-worker", strconv.Itoa(first), "-workers", strconv.Itoa(n), "-rate", fmt.Sprint(f.rate*float64(n)/float64(f.workers)),
			"-batch", strconv.Itoa(batch), "-sample", strconv.Itoa(sample), "-max-blocks", strconv.Itoa(f.maxBlocks*n/f.workers),
			"-duration", f.duration.String(), "-models", strconv.Itoa(f.models), "-out", file)
		if err != nil {
			e.close()
			return nil, err
		}
		e.procs, e.files = append(e.procs, c), append(e.files, file)
		var specs []registry.Worker
		if err := json.Unmarshal([]byte(c.ready), &specs); err != nil {
			e.close()
			return nil, fmt.Errorf("the engine process said %q", c.ready)
		}
		e.specs = append(e.specs, specs...)
	}
	return e, nil
}

// run publishes for the run's duration, once every engine has a subscriber.
func (e *engineSide) run(f flags) (engineResult, error) {
	batch, _ := synthParams(f)
	if e.ws != nil {
		var r engineResult
		if err := waitSubscribed(e.ws, subscribeTimeout(len(e.ws))); err != nil {
			return r, err
		}
		var b0 uint64
		for _, w := range e.ws {
			b0 += w.pub.Stats().Bytes
		}
		r.LoadSeconds = runSynth(e.ws, f.rate, batch, f.duration).Seconds()
		for _, w := range e.ws {
			r.Stored += w.stored
			r.Removed += w.removed
			r.Messages += w.messages
			r.Failed += w.failed
			r.Bytes += w.pub.Stats().Bytes
			r.recs = append(r.recs, w.recs...)
		}
		r.Bytes -= b0
		r.CPUSeconds = -1
		return r, nil
	}
	// Every process at once; their counts add up, the load lasts as long as the longest.
	parts := make([]engineResult, len(e.procs))
	errs := make([]error, len(e.procs))
	var wg sync.WaitGroup
	for i, c := range e.procs {
		wg.Go(func() {
			l, err := c.ask("start")
			if err != nil {
				errs[i] = err
				return
			}
			if err := json.Unmarshal([]byte(l), &parts[i]); err != nil {
				errs[i] = fmt.Errorf("the engine process said %q", l)
				return
			}
			if parts[i].Error != "" {
				errs[i] = errors.New(parts[i].Error)
				return
			}
			recs, err := readArrivals(e.files[i], 1)
			if err != nil {
				errs[i] = err
				return
			}
			parts[i].recs = recs[0]
		})
	}
	wg.Wait()
	var r engineResult
	if err := errors.Join(errs...); err != nil {
		return r, err
	}
	for _, p := range parts {
		r.Stored += p.Stored
		r.Removed += p.Removed
		r.Messages += p.Messages
		r.Failed += p.Failed
		r.Bytes += p.Bytes
		r.CPUSeconds += p.CPUSeconds
		r.LoadSeconds = max(r.LoadSeconds, p.LoadSeconds)
		r.recs = append(r.recs, p.recs...)
	}
	return r, nil
}

func (e *engineSide) close() {
	for _, w := range e.ws {
		w.close()
	}
	for _, c := range e.procs {
		c.close()
	}
}

// subscribeTimeout is how long n engines wait for their subscribers: each replica dials and
// greets every engine, on a machine the whole fleet shares.
func subscribeTimeout(n int) time.Duration {
	return 15*time.Second + time.Duration(n)*20*time.Millisecond
}

func waitSubscribed(ws []*synthWorker, timeout time.Duration) error {
	// A PUB socket drops messages for subscribers that have not joined yet.
	deadline := time.Now().Add(timeout)
	for _, w := range ws {
		for !w.pub.HasSubscribers() {
			if time.Now().After(deadline) {
				return fmt.Errorf("nobody subscribed to %s's KV events", w.id)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

// runEnginesChild is the engine process: it prints the workers as JSON; on each "start" it
// publishes and prints what it published as JSON (records in -out); it keeps its sockets
// open until stdin ends.
func runEnginesChild(f flags) error {
	batch, sample := synthParams(f)
	ws, specs, err := newSynthWorkers(f, uint64(1)<<uint(sample)-1)
	if err != nil {
		return err
	}
	defer func() {
		for _, w := range ws {
			w.close()
		}
	}()
	b, _ := json.Marshal(specs)
	fmt.Println(string(b))
	in := bufio.NewReader(os.Stdin)
	for {
		if l, err := in.ReadString('\n'); err != nil || l != "start\n" {
			return nil
		}
		b, _ = json.Marshal(publishOnce(f, ws, batch))
		fmt.Println(string(b))
	}
}

// publishOnce is one load of the engine process: -rate for -duration, once every engine
// has a subscriber; the records go to -out.
func publishOnce(f flags, ws []*synthWorker, batch int) engineResult {
	var r engineResult
	for _, w := range ws {
		w.stored, w.removed, w.messages, w.failed, w.recs = 0, 0, 0, 0, w.recs[:0]
	}
	if err := waitSubscribed(ws, subscribeTimeout(len(ws))); err != nil {
		r.Error = err.Error()
	} else {
		var b0 uint64
		for _, w := range ws {
			b0 += w.pub.Stats().Bytes
		}
		cpu0 := cpuSeconds()
		r.LoadSeconds = runSynth(ws, f.rate, batch, f.duration).Seconds()
		r.CPUSeconds = cpuSeconds() - cpu0
		for _, w := range ws {
			r.Stored += w.stored
			r.Removed += w.removed
			r.Messages += w.messages
			r.Failed += w.failed
			r.Bytes += w.pub.Stats().Bytes
			r.recs = append(r.recs, w.recs...)
		}
		r.Bytes -= b0
		if err := writeRecs(f.outFile, r.recs); err != nil {
			r.Error = err.Error()
		}
	}
	return r
}

func writeRecs(path string, recs []pubRec) error {
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(fh, 1<<20)
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], uint64(len(recs)))
	w.Write(b[:8])
	for _, r := range recs {
		binary.LittleEndian.PutUint64(b[:8], r.seq)
		binary.LittleEndian.PutUint64(b[8:], uint64(r.at))
		w.Write(b[:])
	}
	if err := w.Flush(); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}
