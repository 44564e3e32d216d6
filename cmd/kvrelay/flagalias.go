package main

import "github.com/spf13/pflag"

// deprecatedAlias registers old as another spelling of the flag new (already registered on
// fs): it sets the same value, still works in scripts, and using it prints one line saying
// to use new instead.
func deprecatedAlias(fs *pflag.FlagSet, old, new string) {
	f := fs.Lookup(new)
	if f == nil {
		panic("deprecatedAlias: no flag --" + new)
	}
	fs.AddFlag(&pflag.Flag{Name: old, Usage: f.Usage, Value: f.Value, DefValue: f.DefValue, NoOptDefVal: f.NoOptDefVal})
	_ = fs.MarkDeprecated(old, "use --"+new)
}
