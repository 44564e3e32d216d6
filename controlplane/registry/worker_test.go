package registry

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

func TestParseWorker(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want Worker
	}{
		{
			name: "minimal gets defaults",
			in:   "id=w1,url=http://127.0.0.1:8001",
			want: Worker{ID: "w1", URL: "http://127.0.0.1:8001", Role: RoleBoth, Engine: "vllm",
				Metrics: "http://127.0.0.1:8001/metrics", Source: SourceFlag},
		},
		{
			name: "every key",
			in: "id=p0,url=http://gpu-0:8000,model=openai/gpt-oss-20b,role=prefill,block-size=32," +
				"kv-events=tcp://gpu-0:5557,kv-events-replay=tcp://gpu-0:5558,metrics=https://gpu-0:9090/m,engine=sglang",
			want: Worker{ID: "p0", URL: "http://gpu-0:8000", Model: "openai/gpt-oss-20b", Role: RolePrefill,
				BlockSize: 32, KVEvents: "tcp://gpu-0:5557", KVEventsReplay: "tcp://gpu-0:5558",
				Metrics: "https://gpu-0:9090/m", Engine: "sglang", Source: SourceFlag},
		},
		{
			name: "offloading tiers",
			in:   "id=w1,url=http://h:1,kv-bytes-per-token=73728,host-bandwidth=25GB/s,disk-bandwidth=800MB/s,shared-bandwidth=2GB/s",
			want: Worker{ID: "w1", URL: "http://h:1", Role: RoleBoth, Engine: "vllm", Metrics: "http://h:1/metrics", Source: SourceFlag,
				KVBytesPerToken: 73728, HostBandwidth: 25e9, DiskBandwidth: 800e6, SharedBandwidth: 2e9},
		},
		{
			name: "bind with wildcard, spaces, trailing slash and empty pairs",
			in:   " id = d1 , url = http://[::1]:8002/ ,, kv-events-bind = tcp://*:5600 , role=decode, engine=sim,",
			want: Worker{ID: "d1", URL: "http://[::1]:8002", Role: RoleDecode, KVEventsBind: "tcp://*:5600",
				Metrics: "http://[::1]:8002/metrics", Engine: "sim", Source: SourceFlag},
		},
		{
			name: "bound endpoint with a topic",
			in:   "id=w3,url=http://10.0.0.3:8000,model=m,kv-events-bind=tcp://*:5557,kv-events-topic=kv@10.0.0.3:8000@m",
			want: Worker{ID: "w3", URL: "http://10.0.0.3:8000", Model: "m", Role: RoleBoth, KVEventsBind: "tcp://*:5557",
				KVEventsTopic: "kv@10.0.0.3:8000@m", Metrics: "http://10.0.0.3:8000/metrics", Engine: "vllm", Source: SourceFlag},
		},
		{
			name: "scheduler limits",
			in:   "id=w4,url=http://h:1,max-num-seqs=4,max-num-batched-tokens=2048",
			want: Worker{ID: "w4", URL: "http://h:1", Role: RoleBoth, Metrics: "http://h:1/metrics", Engine: "vllm",
				MaxNumSeqs: 4, MaxNumBatchedTokens: 2048, Source: SourceFlag},
		},
		{
			name: "value with an equals sign, ipc endpoint",
			in:   "id=w=2,url=http://h:1,model=a=b,kv-events=ipc:///tmp/kv.sock",
			want: Worker{ID: "w=2", URL: "http://h:1", Model: "a=b", Role: RoleBoth, KVEvents: "ipc:///tmp/kv.sock",
				Metrics: "http://h:1/metrics", Engine: "vllm", Source: SourceFlag},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseWorker(tt.in)
			if err != nil {
				t.Fatalf("ParseWorker(%q): %v", tt.in, err)
			}
			if !got.Equal(tt.want) {
				t.Fatalf("ParseWorker(%q)\n got %+v\nwant %+v", tt.in, got, tt.want)
			}
			back, err := ParseWorker(got.String())
			if err != nil || !back.Equal(got) {
				t.Fatalf("ParseWorker(%q) = %+v, %v; want %+v", got.String(), back, err, got)
			}
		})
	}
}

func TestParseWorkerErrors(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"empty", "", "missing id"},
		{"missing id", "url=http://h:1", "missing id"},
		{"missing url", "id=w1", "missing url"},
		{"not key=value", "id=w1,url=http://h:1,oops", `"oops" is not key=value`},
		{"unknown key", "id=w1,url=http://h:1,colour=red", `unknown key "colour"`},
		{"key case matters", "ID=w1,url=http://h:1", `unknown key "ID"`},
		{"duplicate key", "id=w1,id=w2,url=http://h:1", `key "id" given twice`},
		{"https url", "id=w1,url=https://h:1", "want http://host:port"},
		{"url without port", "id=w1,url=http://h", "want http://host:port"},
		{"url with path", "id=w1,url=http://h:1/v1", "want http://host:port"},
		{"url with query", "id=w1,url=http://h:1?x=1", "want http://host:port"},
		{"url bad port", "id=w1,url=http://h:70000", "want 1 to 65535"},
		{"url port zero", "id=w1,url=http://h:0", "want 1 to 65535"},
		{"url not a url", "id=w1,url=h:1", "want http://host:port"},
		{"bad role", "id=w1,url=http://h:1,role=both-ish", `role "both-ish"`},
		{"bad engine", "id=w1,url=http://h:1,engine=tgi", `engine "tgi": want one of vllm, sglang, trtllm, sim`},
		{"block size not a number", "id=w1,url=http://h:1,block-size=16k", "not an integer"},
		{"negative block size", "id=w1,url=http://h:1,block-size=-16", "outside"},
		{"huge block size", "id=w1,url=http://h:1,block-size=1000000", "outside"},
		{"max-num-seqs not a number", "id=w1,url=http://h:1,max-num-seqs=many", "not an integer"},
		{"negative max-num-seqs", "id=w1,url=http://h:1,max-num-seqs=-1", "within"},
		{"bad host bandwidth", "id=w1,url=http://h:1,host-bandwidth=fast", "host-bandwidth"},
		{"negative kv bytes", "id=w1,url=http://h:1,kv-bytes-per-token=-5", "within"},
		{"dial and bind", "id=w1,url=http://h:1,kv-events=tcp://h:5557,kv-events-bind=tcp://*:5557", "choose one"},
		{"dial a wildcard", "id=w1,url=http://h:1,kv-events=tcp://*:5557", "kv-events"},
		{"events without port", "id=w1,url=http://h:1,kv-events=tcp://h", "want tcp://host:port"},
		{"events bad scheme", "id=w1,url=http://h:1,kv-events=udp://h:1", "want tcp://host:port"},
		{"replay alone", "id=w1,url=http://h:1,kv-events-replay=tcp://h:5558", "without kv-events"},
		{"topic alone", "id=w1,url=http://h:1,kv-events-topic=kv@h:1@m", "kv-events-topic without kv-events"},
		{"topic with a control character", "id=w1,url=http://h:1,kv-events-bind=tcp://*:5557,kv-events-topic=kv\x02", "control"},
		{"bad metrics", "id=w1,url=http://h:1,metrics=ftp://h/m", "metrics"},
		{"id with a space", "id=w 1,url=http://h:1", "printable ASCII"},
		{"reserved id", "id=*,url=http://h:1", "reserved"},
		{"model with a space", "id=w1,url=http://h:1,model=my model", "space"},
		{"control character", "id=w1,url=http://h:1,model=a\x01b", "control"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, err := ParseWorker(tt.in)
			if err == nil {
				t.Fatalf("ParseWorker(%q) = %+v, want an error", tt.in, w)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not mention %q", err, tt.want)
			}
		})
	}
}

func TestWorkerString(t *testing.T) {
	w := Worker{ID: "w1", URL: "http://h:1", Role: RoleBoth, Engine: "vllm", Metrics: "http://h:1/metrics", Draining: true}
	if got, want := w.String(), "id=w1,url=http://h:1"; got != want {
		t.Errorf("String() = %q, want %q (defaults and draining left out)", got, want)
	}
	w.Role, w.Engine, w.Metrics, w.BlockSize = RoleDecode, "trtllm", "http://h:2/metrics", 64
	if got, want := w.String(), "id=w1,url=http://h:1,role=decode,block-size=64,metrics=http://h:2/metrics,engine=trtllm"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestWorkerValidateAcceptsUnsetDefaults(t *testing.T) {
	if err := (Worker{ID: "w1", URL: "http://h:1"}).Validate(); err != nil {
		t.Fatalf("Validate of a worker without defaults: %v", err)
	}
}

// xdsWorker is how the control plane announces w to proxies, to check that every worker the
// registry accepts is one a proxy accepts too.
func xdsWorker(w Worker) *xdsv1.Worker {
	x := xds.NewWorker(w.ID, w.URL, w.Model)
	x.Engine = w.Engine
	x.BlockSize = uint32(w.BlockSize)
	role, _ := xds.ParseRole(w.Role)
	x.Role = role
	return x
}

// TestP2PPort: the flag form takes a P2P side channel's port and writes it back; a port
// outside 0–65535 is refused.
func TestP2PPort(t *testing.T) {
	w, err := ParseWorker("id=w6,url=http://h:1,p2p-port=5710")
	if err != nil || w.P2PPort != 5710 || !strings.Contains(w.String(), "p2p-port=5710") {
		t.Fatalf("ParseWorker = %+v (%q), %v", w, w.String(), err)
	}
	for _, bad := range []string{"p2p-port=70000", "p2p-port=-1", "p2p-port=x"} {
		if _, err := ParseWorker("id=w6,url=http://h:1," + bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v", bad, err)
		}
	}
}

func FuzzParseWorker(f *testing.F) {
	for _, s := range []string{
		"id=w1,url=http://127.0.0.1:8001,kv-events=tcp://127.0.0.1:5557",
		"id=p0,url=http://gpu-0:8000,model=openai/gpt-oss-20b,role=prefill,block-size=32,kv-events=tcp://gpu-0:5557,kv-events-replay=tcp://gpu-0:5558,metrics=https://gpu-0:9090/m,engine=sglang",
		" id = d1 , url = http://[::1]:8002/ ,, kv-events-bind = tcp://*:5600 , role=decode, engine=sim,",
		"id=w=2,url=http://h:1,model=a=b,kv-events=ipc:///tmp/kv.sock",
		"id=w3,url=http://10.0.0.3:8000,model=m,kv-events-bind=tcp://*:5557,kv-events-topic=kv@10.0.0.3:8000@m",
		"id=w4,url=http://h:1,max-num-seqs=4,max-num-batched-tokens=2048",
		"id=w5,url=http://h:1,kv-bytes-per-token=73728,host-bandwidth=25GB/s,disk-bandwidth=1.5GB/s,shared-bandwidth=2GB/s,peer-bandwidth=50GB/s",
		"id=w6,url=http://h:1,p2p-port=5710", "id=w6,url=http://h:1,p2p-port=70000", "id=w6,url=http://h:1,p2p-port=-1",
		"id=w1,url=http://h:1,metrics=http://h:1/metrics",
		"id=w1,url=http://h:1,block-size=0",
		"id=w1,url=http://h:1,model=é",
		"id=,url=",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		w, err := ParseWorker(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseWorker(%q): error %v does not wrap ErrInvalid", s, err)
			}
			return
		}
		if err := w.Validate(); err != nil {
			t.Fatalf("ParseWorker(%q) returned an invalid worker: %v", s, err)
		}
		if err := xds.ValidateWorker(xdsWorker(w)); err != nil {
			t.Fatalf("ParseWorker(%q) = %+v, which a proxy refuses: %v", s, w, err)
		}
		back, err := ParseWorker(w.String())
		if err != nil {
			t.Fatalf("ParseWorker(%q) (String of %q): %v", w.String(), s, err)
		}
		if !back.Equal(w) {
			t.Fatalf("round trip of %q via %q:\n got %+v\nwant %+v", s, w.String(), back, w)
		}
	})
}

func TestLoRAModulesFlagForm(t *testing.T) {
	w, err := ParseWorker("id=w1,url=http://h:1,model=base,lora-modules=sql-lora; chat-lora")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(w.LoRAModules, []string{"sql-lora", "chat-lora"}) {
		t.Fatalf("lora-modules %v", w.LoRAModules)
	}
	back, err := ParseWorker(w.String())
	if err != nil || !back.Equal(w) {
		t.Fatalf("round trip of %q: %+v %v", w.String(), back, err)
	}
	for _, bad := range []string{"lora-modules=base", "lora-modules=a;a", "lora-modules=a b"} {
		if _, err := ParseWorker("id=w1,url=http://h:1,model=base," + bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestParseTemplate(t *testing.T) {
	w, err := ParseTemplate("engine=sglang,kv-events=tcp://*:5557,max-num-seqs=32,role=decode")
	if err != nil || w.Engine != "sglang" || w.KVEvents != "tcp://*:5557" || w.MaxNumSeqs != 32 || w.Role != RoleDecode {
		t.Fatalf("ParseTemplate = %+v, %v", w, err)
	}
	for _, bad := range []string{"id=x", "url=http://a:1", "kv-events=tcp://*:port", "role=sideways", "nope=1", "kv-events-topic=t"} {
		if _, err := ParseTemplate(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseTemplate(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}

// FuzzParseTemplate: any --k8s-worker value is read or refused with ErrInvalid, and one read
// makes a valid worker at any address.
func FuzzParseTemplate(f *testing.F) {
	for _, s := range []string{"engine=vllm,kv-events=tcp://*:5557", "role=decode,max-num-seqs=64,lora-modules=a;b", "id=x", "kv-events=tcp://*:x", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		w, err := ParseTemplate(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseTemplate(%q): error %v does not wrap ErrInvalid", s, err)
			}
			return
		}
		tmpl, err := newSliceTemplate(w)
		if err != nil {
			t.Fatalf("ParseTemplate(%q) = %+v, which makes no template: %v", s, w, err)
		}
		if _, err := tmpl.worker("w", "10.0.0.1", 8000); err != nil {
			t.Fatalf("ParseTemplate(%q) makes an invalid worker: %v", s, err)
		}
	})
}
