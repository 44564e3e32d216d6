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
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// engineSide is the W synthetic engines: in this process, or (the default) in a child
// process of this binary, so that the control plane's CPU is measured alone.
type engineSide struct {
	specs []registry.Worker
	ws    []*synthWorker // in process

	proc *child // child
	file string
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
	for i := range f.workers {
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
	_, sample := synthParams(f)
	mask := uint64(1)<<uint(sample) - 1
	if f.inProcess {
		ws, specs, err := newSynthWorkers(f, mask)
		if err != nil {
			return nil, err
		}
		return &engineSide{ws: ws, specs: specs}, nil
	}
	e := &engineSide{file: filepath.Join(dir, "published.bin")}
	c, err := startChildMode("the engine process", "-mode", "engines", "-workers", strconv.Itoa(f.workers), "-rate", fmt.Sprint(f.rate),
		"-batch", strconv.Itoa(f.batch), "-sample", strconv.Itoa(f.sample), "-max-blocks", strconv.Itoa(f.maxBlocks),
		"-duration", f.duration.String(), "-models", strconv.Itoa(f.models), "-out", e.file)
	if err != nil {
		return nil, err
	}
	e.proc = c
	if err := json.Unmarshal([]byte(c.ready), &e.specs); err != nil {
		e.close()
		return nil, fmt.Errorf("the engine process said %q", c.ready)
	}
	return e, nil
}

// run publishes for the run's duration, once every engine has a subscriber.
func (e *engineSide) run(f flags) (engineResult, error) {
	batch, _ := synthParams(f)
	if e.ws != nil {
		var r engineResult
		if err := waitSubscribed(e.ws, 15*time.Second); err != nil {
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
	var r engineResult
	l, err := e.proc.ask("start")
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal([]byte(l), &r); err != nil {
		return r, fmt.Errorf("the engine process said %q", l)
	}
	if r.Error != "" {
		return r, errors.New(r.Error)
	}
	recs, err := readArrivals(e.file, 1)
	if err != nil {
		return r, err
	}
	r.recs = recs[0]
	return r, nil
}

func (e *engineSide) close() {
	for _, w := range e.ws {
		w.close()
	}
	if e.proc != nil {
		e.proc.close()
	}
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
	if err := waitSubscribed(ws, 15*time.Second); err != nil {
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
