package treecheck

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func write(t *testing.T, root, p string, data []byte) {
	t.Helper()
	full := filepath.Join(root, filepath.FromSlash(p))
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(full, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func elf(typ byte) []byte {
	h := make([]byte, 64)
	copy(h, "\x7fELF\x02\x01\x01")
	h[16] = typ
	return h
}

func pe() []byte {
	h := make([]byte, 128)
	copy(h, "MZ")
	h[0x3c] = 0x40
	copy(h[0x40:], "PE\x00\x00")
	return h
}

// The machine folders are joined to the rest of each path at run time, so that this file does
// not itself name a machine path (verify-tree reads it too).
const (
	homeDir  = "/home"
	rootDir  = "/root"
	workDir  = "/work"
	usersDir = "/Users"
)

func TestCheck(t *testing.T) {
	self, err := os.ReadFile(os.Args[0]) // this test binary: a real executable
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		path   string
		data   []byte
		large  bool
		reason string // a substring of the finding; "" for none
	}{
		{"real test binary", "gateway", self, false, "a build output"},
		{"elf executable", "bin/kvrelay", elf(2), false, "ELF executable"},
		{"elf object", "x/foo.o", elf(1), false, "ELF object file"},
		{"elf shared object", "lib/libfoo.so", elf(3), false, "ELF shared object"},
		{"bpf2go object little-endian", "ebpf/probes/runqlat_bpfel.o", elf(1), false, ""},
		{"bpf2go object big-endian", "ebpf/probes/runqlat_bpfeb.o", elf(1), false, ""},
		{"mach-o", "out/kvrelay-darwin", []byte{0xcf, 0xfa, 0xed, 0xfe, 7, 0, 0, 1}, false, "Mach-O"},
		{"pe", "out/kvrelay.exe", pe(), false, "Windows PE"},
		{"MZ text is not PE", "docs/mz.txt", []byte("MZ is how this note starts, and it goes on for long enough to fill sixty-four bytes and more."), false, ""},
		{"go archive", "pkg/x.a", []byte("!<arch>\n__.PKGDEF"), false, "ar archive"},
		{"wasm", "web/x.wasm", []byte("\x00asm\x01\x00\x00\x00"), false, "WebAssembly"},
		{"over the limit", "testdata/big.json", make([]byte, 1025), false, "over the 1024-byte limit"},
		{"listed fixture over the limit", "testdata/listed.json", make([]byte, 1025), true, ""},
		{"home path", "hack/build.sh", []byte("#!/bin/sh\nSRC=" + homeDir + "/alice/src/llm-d\n"), false, "line 2 names an absolute path"},
		{"workspace path", "README.md", []byte("the mirror under " + workDir + "/.mirror/llm-d/ is used\n"), false, "line 1"},
		{"root home", "x.go", []byte("// see " + rootDir + "/go/pkg/mod/x\n"), false, "line 1"},
		{"macOS home", "x.md", []byte("(`" + usersDir + "/bob/kvrelay/`)\n"), false, "line 1"},
		{"system paths are fine", "ok.sh", []byte("/usr/bin/python3 /tmp/x/y /var/lib/kvrelay/ /sys/fs/cgroup/unified/\n"), false, ""},
		{"a URL's path is fine", "ok.md", []byte("https://example.com" + homeDir + "/docs/ and ." + workDir + "/x/\n"), false, ""},
		{"checksums are skipped", "go.sum", []byte(homeDir + "/alice/x/ h1:abc\n"), false, ""},
		{"vendored code is skipped", "third_party/gnet/x.go", []byte("// " + homeDir + "/panjf2000/gnet/\n"), false, ""},
	}
	root := t.TempDir()
	large := map[string]bool{}
	var paths []string
	for _, c := range cases {
		write(t, root, c.path, c.data)
		paths = append(paths, c.path)
		if c.large {
			large[c.path] = true
		}
	}
	paths = append(paths, "deleted/in/worktree.go") // tracked but gone: not an error
	found, err := Check(Config{Root: root, LargeFixtures: large, MaxSize: 1024}, paths)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var mine []string
			for _, f := range found {
				if f.Path == c.path {
					mine = append(mine, f.Reason)
				}
			}
			switch {
			case c.reason == "" && len(mine) > 0:
				t.Errorf("%s: unexpected findings %q", c.path, mine)
			case c.reason != "" && !slices.ContainsFunc(mine, func(r string) bool { return strings.Contains(r, c.reason) }):
				t.Errorf("%s: findings %q, want one with %q", c.path, mine, c.reason)
			}
		})
	}
}

func TestReadList(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "list.txt")
	write(t, dir, "list.txt", []byte("# comment\n\n a/b.json \nc.bin\n"))
	m, err := ReadList(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 || !m["a/b.json"] || !m["c.bin"] {
		t.Fatalf("ReadList = %v", m)
	}
	if m, err := ReadList(filepath.Join(dir, "missing")); err != nil || len(m) != 0 {
		t.Fatalf("missing list: %v, %v", m, err)
	}
}
