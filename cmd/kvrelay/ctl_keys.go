package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// ctlKeysCmd manages the API keys the control plane gives its proxies.
func ctlKeysCmd(o *ctlOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "keys",
		Short: "List the API keys proxies take from the control plane (their SHA-256s, never the keys)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var l operatorv1.ListApiKeysResponse
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/keys", nil, &l); err != nil {
				return err
			}
			return c.print(&l, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tSHA256\tTENANT\tWEIGHT\tRPS\tPROMPT TPS\tOUTPUT TPM\tCACHE")
				for _, k := range l.Keys {
					cache := k.GetCache()
					if cache == "" {
						cache = "-"
					}
					fmt.Fprintf(tw, "%s\t%.12s…\t%s\t%s\t%s\t%s\t%s\t%s\n", k.GetId(), k.GetSha256(), k.GetTenant(), ctlLimit(k.GetWeight()),
						ctlLimit(k.GetRps()), ctlLimit(k.GetPromptTps()), ctlLimit(k.GetOutputTpm()), cache)
				}
				tw.Flush()
			})
		},
	}
	var keyFile, sum string
	k := &operatorv1.ApiKey{}
	add := &cobra.Command{
		Use:   "add ID --tenant NAME (--key-file FILE | --sha256 HEX)",
		Short: "Give proxies an API key (or replace the one of that id)",
		Long: `add stores an API key in the control plane, which gives it to every proxy: a request
with it is the tenant's, with the tenant's weight, budgets and cache region. The key is read
from --key-file ("-": standard input), never from the command line, and only its SHA-256
leaves this machine; or give the SHA-256 yourself (--sha256). The keys of one tenant must
agree on its weight, budgets and region.`,
		Example: "  openssl rand -hex 24 | tee key | kvrelay ctl keys add ci --tenant acme --rps 20 --key-file -",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			put := &operatorv1.ApiKey{Id: args[0], Tenant: k.Tenant, Weight: k.Weight, Rps: k.Rps, PromptTps: k.PromptTps,
				OutputTpm: k.OutputTpm, Cache: k.Cache, Sha256: sum}
			switch {
			case keyFile != "" && sum != "":
				return fmt.Errorf("give --key-file or --sha256, not both")
			case keyFile != "":
				var b []byte
				var err error
				if keyFile == "-" {
					b, err = io.ReadAll(io.LimitReader(cmd.InOrStdin(), 1<<16))
				} else {
					b, err = os.ReadFile(keyFile)
				}
				if err != nil {
					return fmt.Errorf("reading the key: %w", err)
				}
				key := strings.TrimSpace(string(b))
				if key == "" {
					return fmt.Errorf("the key file %s is empty", keyFile)
				}
				h := sha256.Sum256([]byte(key))
				put.Sha256 = hex.EncodeToString(h[:]) // the key itself stays here
			case sum == "":
				return fmt.Errorf("give the key (--key-file) or its SHA-256 (--sha256)")
			}
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var got operatorv1.ApiKey
			if err := c.call(cmd.Context(), http.MethodPut, "/v1/keys/"+url.PathEscape(args[0]), put, &got); err != nil {
				return err
			}
			return c.print(&got, func(w io.Writer) {
				fmt.Fprintf(w, "key %s of tenant %s: sha256 %s\n", got.GetId(), got.GetTenant(), got.GetSha256())
			})
		},
	}
	f := add.Flags()
	f.StringVar(&keyFile, "key-file", "", "file holding the key (\"-\": standard input)")
	f.StringVar(&sum, "sha256", "", "the key's SHA-256 in hex, instead of the key")
	f.StringVar(&k.Tenant, "tenant", "", "the tenant the key is (required)")
	f.Float64Var(&k.Weight, "weight", 0, "the tenant's share when tenants contend (0: 1)")
	f.Float64Var(&k.Rps, "rps", 0, "the tenant's requests per second (0: no limit)")
	f.Float64Var(&k.PromptTps, "prompt-tps", 0, "the tenant's prompt tokens per second (0: no limit)")
	f.Float64Var(&k.OutputTpm, "output-tpm", 0, "the tenant's generated tokens per minute (0: no limit)")
	f.StringVar(&k.Cache, "cache", "", "the tenant's cache region (\"\": its own)")
	_ = add.MarkFlagRequired("tenant")
	rm := &cobra.Command{
		Use:     "rm ID",
		Aliases: []string{"remove"},
		Short:   "Take an API key away from the proxies",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var r operatorv1.DeleteApiKeyResponse
			if err := c.call(cmd.Context(), http.MethodDelete, "/v1/keys/"+url.PathEscape(args[0]), nil, &r); err != nil {
				return err
			}
			return c.print(&r, func(w io.Writer) { fmt.Fprintf(w, "removed key %s\n", args[0]) })
		},
	}
	cmd.AddCommand(add, rm)
	return cmd
}

// ctlLimit shows a limit or weight, "-" for none.
func ctlLimit(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%g", v)
}
