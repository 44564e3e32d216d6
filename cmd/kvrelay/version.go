package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// commit is set at link time by `make build` (-X main.commit=…); without it the commit
// comes from the build's VCS stamp, when there is one.
var commit string

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print kvrelay's module version, commit and Go version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			writeVersion(cmd.OutOrStdout(), commit)
			return nil
		},
	}
}

// writeVersion writes one line: kvrelay <module version> commit <commit>[ (modified)] <go
// version> <os>/<arch>.
func writeVersion(w io.Writer, commit string) {
	version, modified := "(devel)", false
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v := bi.Main.Version; v != "" {
			version = v
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision" && commit == "":
				commit = s.Value
			case s.Key == "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if commit == "" {
		commit = "unknown"
	}
	if len(commit) > 12 {
		commit = commit[:12]
	}
	dirty := ""
	if modified {
		dirty = " (modified)"
	}
	fmt.Fprintf(w, "kvrelay %s commit %s%s %s %s/%s\n", version, commit, dirty, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
