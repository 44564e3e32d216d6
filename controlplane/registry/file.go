package registry

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"
)

// MaxFileSize bounds a workers file; a larger one is refused rather than read.
const MaxFileSize = 16 << 20

// fileDoc is the workers file: a top-level `workers:` list of Worker.
//
//	workers:
//	  - id: w1
//	    url: http://10.0.0.1:8000
//	    kv-events: tcp://10.0.0.1:5557
//	  - id: w2
//	    url: http://10.0.0.2:8000
//	    role: decode
type fileDoc struct {
	Workers []Worker `yaml:"workers"`
}

// LoadFile reads and parses the workers file at path (see ParseWorkers).
func LoadFile(path string) ([]Worker, error) {
	data, err := readFile(path)
	if err != nil {
		return nil, err
	}
	ws, err := ParseWorkers(data)
	if err != nil {
		return nil, fmt.Errorf("loading workers file %s: %w", path, err)
	}
	return ws, nil
}

func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading workers file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading workers file %s: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%w: workers file %s is larger than %d bytes", ErrInvalid, path, MaxFileSize)
	}
	return data, nil
}

// ParseWorkers parses a workers file: one YAML document whose only key is `workers`, a list
// of workers with the fields of the flag form (id, url, model, role, block-size, kv-events,
// kv-events-bind, kv-events-topic, kv-events-replay, metrics, engine) and draining. Unknown fields, invalid
// workers and duplicate ids are errors (wrapping ErrInvalid). An empty document means no
// workers. The workers come back in file order with their defaults filled in and Source
// SourceFile.
func ParseWorkers(data []byte) ([]Worker, error) {
	var doc fileDoc
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	var extra yaml.Node
	switch err := dec.Decode(&extra); {
	case err == nil:
		return nil, fmt.Errorf("%w: more than one YAML document", ErrInvalid)
	case !errors.Is(err, io.EOF):
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	seen := make(map[string]int, len(doc.Workers))
	ws := make([]Worker, 0, len(doc.Workers))
	for i, w := range doc.Workers {
		w = w.WithDefaults()
		w.Source = SourceFile
		if err := w.Validate(); err != nil {
			return nil, fmt.Errorf("workers[%d]: %w", i, err)
		}
		if j, dup := seen[w.ID]; dup {
			return nil, fmt.Errorf("%w: workers[%d]: id %q already used by workers[%d]", ErrInvalid, i, w.ID, j)
		}
		seen[w.ID] = i
		ws = append(ws, w)
	}
	return ws, nil
}
