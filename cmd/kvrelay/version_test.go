package main

import (
	"bytes"
	"runtime"
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
