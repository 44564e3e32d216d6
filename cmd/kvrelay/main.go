// Command kvrelay is the single kvrelay binary: the simulated engine, the embedded local
// deployment, the proxy, the control plane, the benchmark and the operator tools.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// The first SIGINT or SIGTERM stops gracefully (a proxy drains its requests in
		// flight); from then on the signals' default applies, so a second one stops at once.
		<-ctx.Done()
		stop()
	}()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "kvrelay:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "kvrelay",
		Short:         "KV-cache-aware inference gateway",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newSimCmd(), newUpCmd(), newProxyCmd(), newEPPCmd(), newControlPlaneCmd(), newBenchCmd(), newCtlCmd(), newProfileCmd(), newVersionCmd())
	return root
}
