package doccheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The names of missing documents are built here, so that this file does not cite them itself.
var (
	arch   = "ARCHITECTURE" + ".md"
	design = "design" + ".md"
	docs   = "docs" + "/"
)

func TestCheck(t *testing.T) {
	cases := []struct {
		name, path, text string
		reason           string // a substring of the finding; "" for none
		line             int
	}{
		{"comment cites a missing design document", "engines/x/x.go", "package x\n\n// The seed is " + arch + "'s.\n", "cites " + arch, 3},
		{"a path to it is still missing", "x/doc.go", "// See " + docs + arch + ".\npackage x\n", "cites " + docs + arch, 1},
		{"any case", "x/notes.txt", "see " + design + "\n", "cites " + design, 1},
		{"a tracked design document may be cited", "y/y.go", "// see HACKING/" + arch + "\n", "", 0},
		{"comment cites a missing docs file", "dataplane/route/doc.go", "// The cost (" + docs + "routing-costs.md).\npackage route\n", "cites " + docs + "routing-costs.md", 1},
		{"docs file that exists", "engines/blockhash/doc.go", "// Package blockhash hashes blocks (docs/block-hashing.md).\npackage blockhash\n", "", 0},
		{"docs path in a script", "hack/x.sh", "echo see " + docs + "timing.md\n", "cites " + docs + "timing.md", 1},
		{"relative docs path resolves from the file", "cmd/kvrelay/README.md", "as [the note](../../docs/block-hashing.md#chain) says\n", "", 0},
		{"relative docs path that does not", "cmd/kvrelay/NOTES.md", "see ../" + docs + "block-hashing.md\n", "cites ../" + docs + "block-hashing.md", 1},
		{"another project's docs path", "engines/sglang/testdata/README.md", "the scrape in SGLang's `docs/references/production_metrics.md`\n", "", 0},
		{"a URL's docs path", "engines/vllm/README.md", "https://github.com/vllm-project/vllm/blob/main/docs/design/metrics.md\n", "", 0},
		{"a longer path ending in docs/", "hack/y.md", "written to out/docs/summary.md\n", "", 0},
		{"markdown link to a missing note", "docs/README.md", "- [routing](routing-costs.md): the cost\n", "links to routing-costs.md", 1},
		{"markdown link to a note that exists", "docs/routing-cost.md", "[hashing](block-hashing.md#seed)\n", "", 0},
		{"markdown links that leave the repository", "docs/timing-model.md", "[a](https://example.com/x.md) [b](#top) [c](../Makefile)\n", "", 0},
		{"package doc in the future tense", "controlplane/doc.go", "// Package controlplane will hold the control plane.\npackage controlplane\n", "future tense", 1},
		{"shall", "xds/doc.go", "// Package xds shall carry the protocol.\npackage xds\n", "future tense", 1},
		{"present tense", "xds/server/doc.go", "// Package server is the control plane's side of xDS; it will not block.\npackage server\n", "", 0},
		{"a future-tense package line outside Go is prose", "docs/x.txt", "// Package x will hold\n", "", 0},
		{"vendored code is skipped", "third_party/gnet/x.go", "// Package gnet will be fast; see " + arch + "\n", "", 0},
	}
	root := t.TempDir()
	var paths []string
	write := func(p, text string) {
		full := filepath.Join(root, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	for _, c := range cases {
		write(c.path, c.text)
	}
	// The files citations may name.
	write("docs/block-hashing.md", "# Block hashing\n")
	write("HACKING/"+arch, "# notes\n")
	write("bin/blob", "\x00\x01 cites "+arch)       // binary: skipped
	paths = append(paths, "deleted/in/worktree.go") // tracked but gone: not an error
	found, err := Check(root, paths)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var mine []Finding
			for _, f := range found {
				if f.Path == c.path {
					mine = append(mine, f)
				}
			}
			switch {
			case c.reason == "" && len(mine) > 0:
				t.Errorf("%s: unexpected findings %v", c.path, mine)
			case c.reason != "" && !slices.ContainsFunc(mine, func(f Finding) bool { return strings.Contains(f.Reason, c.reason) && f.Line == c.line }):
				t.Errorf("%s: findings %v, want one at line %d with %q", c.path, mine, c.line, c.reason)
			}
		})
	}
	for _, f := range found {
		if f.Path == "bin/blob" || f.Path == "HACKING/"+arch || f.Path == "docs/block-hashing.md" {
			t.Errorf("unexpected finding %v", f)
		}
	}
}

// TestRepository runs the check over this repository's tracked files, as make verify does,
// so that `make test` (what CI runs) fails on a stale citation too. It skips outside a git
// checkout.
func TestRepository(t *testing.T) {
	root := filepath.Join("..", "..")
	out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output()
	if err != nil {
		t.Skipf("not a git checkout (git ls-files: %v)", err)
	}
	var paths []string
	for _, p := range strings.Split(string(out), "\x00") {
		if p != "" {
			paths = append(paths, p)
		}
	}
	found, err := Check(root, paths)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		t.Error(f)
	}
}
