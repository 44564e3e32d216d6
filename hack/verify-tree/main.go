// Command verify-tree fails when kvrelay's repository tracks a build output (an executable,
// object file or archive; bpf2go's probe objects aside), a file over 4 MiB that
// hack/large-fixtures.txt does not list, or an absolute path of one machine's home or
// workspace. `make verify` runs it from the repository's root.
package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/kvrelay/kvrelay/internal/treecheck"
)

func main() {
	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "verify-tree: git ls-files:", err)
		os.Exit(2)
	}
	var paths []string
	for _, p := range bytes.Split(out, []byte{0}) {
		if len(p) > 0 {
			paths = append(paths, string(p))
		}
	}
	large, err := treecheck.ReadList("hack/large-fixtures.txt")
	if err != nil {
		fmt.Fprintln(os.Stderr, "verify-tree:", err)
		os.Exit(2)
	}
	found, err := treecheck.Check(treecheck.Config{Root: ".", LargeFixtures: large}, paths)
	if err != nil {
		fmt.Fprintln(os.Stderr, "verify-tree:", err)
		os.Exit(2)
	}
	if len(found) > 0 {
		lines := make([]string, len(found))
		for i, f := range found {
			lines[i] = "  " + f.String()
		}
		fmt.Fprintf(os.Stderr, "verify-tree: %d tracked file(s) that do not belong in the repository:\n%s\n", len(found), strings.Join(lines, "\n"))
		os.Exit(1)
	}
}
