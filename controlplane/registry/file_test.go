package registry

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

func TestLoadFile(t *testing.T) {
	ws, err := LoadFile(filepath.Join("testdata", "workers.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	want := []Worker{
		{ID: "w0", URL: "http://10.0.0.10:8000", Model: "openai/gpt-oss-20b", Role: RoleBoth, BlockSize: 16,
			KVEvents: "tcp://10.0.0.10:5557", KVEventsReplay: "tcp://10.0.0.10:5558",
			Metrics: "http://10.0.0.10:8000/metrics", Engine: "vllm", Source: SourceFile},
		{ID: "w1", URL: "http://10.0.0.11:8000", Model: "openai/gpt-oss-20b", Role: RoleBoth,
			KVEvents: "tcp://10.0.0.11:5557", Metrics: "http://10.0.0.11:8000/metrics", Engine: "vllm",
			Draining: true, Source: SourceFile},
		{ID: "p0", URL: "http://10.0.1.10:30000", Role: RolePrefill, KVEventsBind: "tcp://*:5600",
			Metrics: "http://10.0.1.10:30000/metrics", Engine: "sglang", Source: SourceFile},
		{ID: "d0", URL: "http://10.0.1.11:30000", Role: RoleDecode,
			Metrics: "http://10.0.1.11:30000/metrics", Engine: "sglang", Source: SourceFile},
	}
	if !slices.EqualFunc(ws, want, Worker.Equal) {
		t.Fatalf("LoadFile:\n got %+v\nwant %+v", ws, want)
	}
}

func TestLoadFileMissing(t *testing.T) {
	_, err := LoadFile(filepath.Join(t.TempDir(), "nope.yaml"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("LoadFile of a missing file: %v, want ErrNotExist", err)
	}
}

func TestParseWorkers(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		n       int
		wantErr string
	}{
		{name: "empty file", in: "", n: 0},
		{name: "comments only", in: "# nothing yet\n", n: 0},
		{name: "empty list", in: "workers: []\n", n: 0},
		{name: "one", in: "workers:\n  - {id: a, url: 'http://h:1'}\n", n: 1},
		{name: "duplicate id", in: "workers:\n  - {id: a, url: 'http://h:1'}\n  - {id: a, url: 'http://h:2'}\n",
			wantErr: `workers[1]: id "a" already used by workers[0]`},
		{name: "unknown field", in: "workers:\n  - {id: a, url: 'http://h:1', colour: red}\n", wantErr: "colour"},
		{name: "source is not a field", in: "workers:\n  - {id: a, url: 'http://h:1', source: api}\n", wantErr: "source"},
		{name: "unknown top-level key", in: "worker:\n  - {id: a, url: 'http://h:1'}\n", wantErr: "worker"},
		{name: "invalid worker", in: "workers:\n  - {id: a, url: 'http://h:1', role: leader}\n", wantErr: `workers[0]: invalid: worker "a": role "leader"`},
		{name: "missing url", in: "workers:\n  - {id: a}\n", wantErr: "missing url"},
		{name: "bad block size", in: "workers:\n  - {id: a, url: 'http://h:1', block-size: big}\n", wantErr: "line 2: cannot unmarshal"},
		{name: "not a mapping", in: "- a\n- b\n", wantErr: "cannot unmarshal"},
		{name: "two documents", in: "workers: []\n---\nworkers: []\n", wantErr: "more than one YAML document"},
		{name: "syntax error", in: "workers: [\n", wantErr: "yaml"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws, err := ParseWorkers([]byte(tt.in))
			if tt.wantErr != "" {
				if err == nil {
					t.Fatalf("ParseWorkers = %+v, want an error with %q", ws, tt.wantErr)
				}
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %q: want ErrInvalid mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(ws) != tt.n {
				t.Fatalf("got %d workers, want %d", len(ws), tt.n)
			}
		})
	}
}

func FuzzParseWorkers(f *testing.F) {
	seed, err := os.ReadFile(filepath.Join("testdata", "workers.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seed)
	for _, s := range []string{
		"",
		"workers: []\n",
		"workers:\n  - {id: a, url: 'http://h:1', model: \"1.0\", block-size: 0x10}\n",
		"workers:\n  - {id: a, url: 'http://h:1'}\n  - {id: a, url: 'http://h:2'}\n",
		"workers:\n  - &w {id: a, url: 'http://h:1'}\n  - *w\n",
		"workers: [\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1<<16 {
			return
		}
		ws, err := ParseWorkers(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		ids := map[string]bool{}
		for _, w := range ws {
			if err := w.Validate(); err != nil {
				t.Fatalf("invalid worker %+v: %v", w, err)
			}
			if w.Source != SourceFile {
				t.Fatalf("worker %q has source %q", w.ID, w.Source)
			}
			if ids[w.ID] {
				t.Fatalf("duplicate id %q", w.ID)
			}
			ids[w.ID] = true
			// Every worker of a file also has a flag form.
			back, err := ParseWorker(w.String())
			if err != nil {
				t.Fatalf("ParseWorker(%q): %v", w.String(), err)
			}
			back.Source, back.Draining = w.Source, w.Draining
			if !back.Equal(w) {
				t.Fatalf("flag form %q of a file worker:\n got %+v\nwant %+v", w.String(), back, w)
			}
		}
		out, err := yaml.Marshal(fileDoc{Workers: ws})
		if err != nil {
			t.Fatalf("marshalling %+v: %v", ws, err)
		}
		again, err := ParseWorkers(out)
		if err != nil {
			t.Fatalf("parsing the marshalled file %q: %v", out, err)
		}
		if len(ws) == 0 {
			ws = nil
		}
		if len(again) == 0 {
			again = nil
		}
		if !slices.EqualFunc(ws, again, Worker.Equal) {
			t.Fatalf("round trip through %q:\n got %+v\nwant %+v", out, again, ws)
		}
	})
}
