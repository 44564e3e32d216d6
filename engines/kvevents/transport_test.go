package kvevents

import "testing"

func TestZmqEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://127.0.0.1:5557": bufferedTCP + "://127.0.0.1:5557",
		"tcp://*:5557":         bufferedTCP + "://*:5557",
		"ipc:///tmp/kv":        "ipc:///tmp/kv",
		"inproc://kv":          "inproc://kv",
	} {
		if got := zmqEndpoint(in); got != want {
			t.Errorf("zmqEndpoint(%q) = %q, want %q", in, got, want)
		}
	}
}
