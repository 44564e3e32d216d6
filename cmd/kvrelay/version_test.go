package main

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"strconv"
	"strings"
	"testing"
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
