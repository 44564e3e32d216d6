package policy

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// Custom is the policy name of a routing policy given as a Profile: its filters, scorers
// and picker, not a built-in name, decide.
const Custom = "custom"

// Profile is a routing policy as data, as the Kubernetes scheduler framework's profiles and
// the llm-d router's EndpointPickerConfig are: filters that remove workers, scorers whose
// weighted costs add up per worker, a picker that chooses by the costs, and, optionally, a
// spread picker that chooses instead when no worker caches the prompt's share the policy's
// cache threshold asks for. Plugins are named as the data plane's registry
// (dataplane/route.Registry) names them; the built-in policy names are presets of this form
// (route.Preset). The busy thresholds, tier weights and session TTL stay the policy's own.
type Profile struct {
	Filters []Plugin `json:"filters,omitempty"`
	Scorers []Plugin `json:"scorers,omitempty"`
	Picker  Plugin   `json:"picker"`
	Spread  *Plugin  `json:"spread,omitempty"`
}

// Plugin is one filter, scorer or picker: its registered name, for a scorer the weight its
// cost is multiplied by, and named numeric parameters.
type Plugin struct {
	Name   string             `json:"name"`
	Weight float64            `json:"weight,omitempty"`
	Params map[string]float64 `json:"params,omitempty"`
}

// Limits of a profile, so that a pushed one cannot grow a proxy's routing without bound.
const (
	MaxPlugins = 16
	MaxParams  = 16
)

// Check reports what makes p malformed whatever the registry: too many plugins or
// parameters, an empty or overlong name, a weight or parameter that is not a finite number
// in [0, MaxWeight]. Whether each plugin exists is the registry's to say.
func (p Profile) Check() error {
	if len(p.Filters) > MaxPlugins || len(p.Scorers) > MaxPlugins {
		return fmt.Errorf("profile: at most %d filters and %d scorers", MaxPlugins, MaxPlugins)
	}
	check := func(kind string, pl Plugin) error {
		if pl.Name == "" || len(pl.Name) > 64 || strings.TrimSpace(pl.Name) != pl.Name {
			return fmt.Errorf("profile: %s %q: want a plugin name", kind, pl.Name)
		}
		if len(pl.Params) > MaxParams {
			return fmt.Errorf("profile: %s %s: at most %d parameters", kind, pl.Name, MaxParams)
		}
		if !finite(pl.Weight) {
			return fmt.Errorf("profile: %s %s: weight %g outside [0, %g]", kind, pl.Name, pl.Weight, MaxWeight)
		}
		for k, v := range pl.Params {
			if !finite(v) {
				return fmt.Errorf("profile: %s %s: parameter %s %g outside [0, %g]", kind, pl.Name, k, v, MaxWeight)
			}
		}
		return nil
	}
	for _, f := range p.Filters {
		if err := check("filter", f); err != nil {
			return err
		}
	}
	for _, s := range p.Scorers {
		if err := check("scorer", s); err != nil {
			return err
		}
	}
	if err := check("picker", p.Picker); err != nil {
		return err
	}
	if p.Spread != nil {
		return check("spread picker", *p.Spread)
	}
	return nil
}

// MaxWeight bounds a profile's weights and parameters, as it does a policy's overlap weight.
const MaxWeight = 1e6

func finite(v float64) bool { return !math.IsNaN(v) && v >= 0 && v <= MaxWeight }

// Clone returns a deep copy of p.
func (p Profile) Clone() Profile {
	c := Profile{Filters: clonePlugins(p.Filters), Scorers: clonePlugins(p.Scorers), Picker: p.Picker.clone()}
	if p.Spread != nil {
		s := p.Spread.clone()
		c.Spread = &s
	}
	return c
}

func (pl Plugin) clone() Plugin {
	if pl.Params != nil {
		m := make(map[string]float64, len(pl.Params))
		for k, v := range pl.Params {
			m[k] = v
		}
		pl.Params = m
	}
	return pl
}

func clonePlugins(ps []Plugin) []Plugin {
	if ps == nil {
		return nil
	}
	out := slices.Clone(ps)
	for i := range out {
		out[i] = out[i].clone()
	}
	return out
}
