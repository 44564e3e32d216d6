// Command verify-docs fails when a file kvrelay's repository tracks cites a design document
// the repository does not contain, or opens a package doc comment in the future tense
// (internal/doccheck). `make verify` runs it from the repository's root.
package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/kvrelay/kvrelay/internal/doccheck"
)

func main() {
	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "verify-docs: git ls-files:", err)
		os.Exit(2)
	}
	var paths []string
	for _, p := range bytes.Split(out, []byte{0}) {
		if len(p) > 0 {
			paths = append(paths, string(p))
		}
	}
	found, err := doccheck.Check(".", paths)
	if err != nil {
		fmt.Fprintln(os.Stderr, "verify-docs:", err)
		os.Exit(2)
	}
	if len(found) > 0 {
		lines := make([]string, len(found))
		for i, f := range found {
			lines[i] = "  " + f.String()
		}
		fmt.Fprintf(os.Stderr, "verify-docs: %d stale citation(s) or package doc(s):\n%s\n", len(found), strings.Join(lines, "\n"))
		os.Exit(1)
	}
}
