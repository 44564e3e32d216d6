package workload

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// param is one parameter of a built-in workload: its key, default and meaning (the README
// table is written from these).
type param struct {
	key, def, doc string
}

// params holds a spec's parameter values; typed getters record the first bad value.
type params struct {
	name  string
	order []param
	vals  map[string]string
	err   error
}

func parseParams(name string, defs []param, s string, has bool) (*params, error) {
	p := &params{name: name, order: defs, vals: make(map[string]string, len(defs))}
	known := make(map[string]bool, len(defs))
	for _, d := range defs {
		known[d.key] = true
		p.vals[d.key] = d.def
	}
	if !has || s == "" {
		return p, nil
	}
	for kv := range strings.SplitSeq(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" {
			return nil, fmt.Errorf("parsing workload %s: %w: %q is not key=value", name, ErrSpec, kv)
		}
		if !known[k] {
			keys := make([]string, len(defs))
			for i, d := range defs {
				keys[i] = d.key
			}
			return nil, fmt.Errorf("parsing workload %s: %w: unknown parameter %q (known: %s)",
				name, ErrSpec, k, strings.Join(keys, ", "))
		}
		p.vals[k] = v
	}
	return p, nil
}

// canonical writes the spec back with every parameter in declaration order.
func (p *params) canonical() string {
	var b strings.Builder
	b.WriteString(p.name)
	for i, d := range p.order {
		if i == 0 {
			b.WriteByte(':')
		} else {
			b.WriteByte(',')
		}
		b.WriteString(d.key)
		b.WriteByte('=')
		b.WriteString(p.vals[d.key])
	}
	return b.String()
}

func (p *params) fail(key, v, want string) {
	if p.err == nil {
		p.err = fmt.Errorf("parsing workload %s: %w: %s=%q: want %s", p.name, ErrSpec, key, v, want)
	}
}

// int returns an integer parameter in [lo, hi].
func (p *params) int(key string, lo, hi int) int {
	v := p.vals[key]
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		p.fail(key, v, fmt.Sprintf("an integer in [%d, %d]", lo, hi))
		return lo
	}
	return n
}

// float returns a number in [lo, hi].
func (p *params) float(key string, lo, hi float64) float64 {
	v := p.vals[key]
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f >= lo && f <= hi) {
		p.fail(key, v, fmt.Sprintf("a number in [%g, %g]", lo, hi))
		return lo
	}
	return f
}

// duration returns a non-negative duration: a Go duration or plain seconds.
func (p *params) duration(key string) time.Duration {
	v := p.vals[key]
	d, err := time.ParseDuration(v)
	if err != nil {
		f, ferr := strconv.ParseFloat(v, 64)
		if ferr != nil || f < 0 || f > 1e9 {
			p.fail(key, v, "a duration (2s, 150ms) or seconds")
			return 0
		}
		d = time.Duration(f * float64(time.Second))
	}
	if d < 0 {
		p.fail(key, v, "a non-negative duration")
		return 0
	}
	return d
}

// bool returns a boolean parameter.
func (p *params) bool(key string) bool {
	v := p.vals[key]
	b, err := strconv.ParseBool(v)
	if err != nil {
		p.fail(key, v, "true or false")
	}
	return b
}

// string returns a string parameter.
func (p *params) string(key string) string { return p.vals[key] }
