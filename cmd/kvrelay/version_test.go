package main

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

func TestVersion(t *testing.T) {
	var out bytes.Buffer
	root := newRootCmd()
	root.SetOut(&out)
	root.SetArgs([]string{"version"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	line := out.String()
	if !strings.HasPrefix(line, "kvrelay ") || !strings.Contains(line, " commit ") || !strings.Contains(line, runtime.Version()) {
		t.Fatalf("version: %q", line)
	}
	out.Reset()
	writeVersion(&out, "0123456789abcdef0123")
	if !strings.Contains(out.String(), "commit 0123456789ab ") {
		t.Fatalf("a linked commit: %q", out.String())
	}
}

// TestUpPortInUseSaysWhatToDo: a second kvrelay up on the same ports is told which flags
// move it.
func TestUpPortInUseSaysWhatToDo(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	port := held.Addr().(*net.TCPAddr).Port
	root := newRootCmd()
	root.SetOut(io.Discard)
	root.SetArgs([]string{"up", "--ebpf", "off", "--base-port", strconv.Itoa(port), "--workers", "1"})
	err = root.Execute()
	if err == nil || !strings.Contains(err.Error(), "address already in use") || !strings.Contains(err.Error(), "--base-port") {
		t.Fatalf("up on a port in use: %v", err)
	}
}

// TestDeprecatedSpellingsStillWork: each renamed flag's old spelling sets the new one.
func TestDeprecatedSpellingsStillWork(t *testing.T) {
	for _, c := range []struct {
		cmd          *cobra.Command
		old, new, v  string
		wantInChange string
	}{
		{newSimCmd(), "max-request-bytes", "max-body-bytes", "12345", "12345"},
		{newBenchCmd(), "speedup", "replay-speedup", "3", "3"},
		{newProfileCmd(), "out", "file", "p.json", "p.json"},
	} {
		fs := c.cmd.Flags()
		if c.cmd.Name() == "bench" {
			// The bench flags live on its run and compare subcommands.
			for _, sub := range c.cmd.Commands() {
				if sub.Name() == "compare" {
					fs = sub.Flags()
				}
			}
		}
		if err := fs.Parse([]string{"--" + c.old, c.v}); err != nil {
			t.Fatalf("%s --%s: %v", c.cmd.Name(), c.old, err)
		}
		if got := fs.Lookup(c.new).Value.String(); got != c.wantInChange {
			t.Errorf("%s --%s %s: --%s is %q", c.cmd.Name(), c.old, c.v, c.new, got)
		}
		if fs.Lookup(c.old).Deprecated == "" {
			t.Errorf("%s --%s is not marked deprecated", c.cmd.Name(), c.old)
		}
	}
}
