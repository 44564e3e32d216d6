package planner

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Status is what GET /v1/planner/decisions answers.
type Status struct {
	DryRun    bool                `json:"dry_run"`
	TTFTMs    float64             `json:"ttft_target_ms"`
	ITLMs     float64             `json:"itl_target_ms"`
	Interval  string              `json:"interval"`
	Predictor string              `json:"predictor"`
	Pools     map[Pool]PoolLimits `json:"pools"`
	Replicas  map[Pool]int        `json:"replicas"`
	Decisions []Decision          `json:"decisions"`
}

// Status returns the planner's configuration summary, pool sizes and the last limit
// decisions (all when limit ≤ 0), oldest first.
func (p *Planner) Status(limit int) Status {
	ds := p.Decisions()
	if limit > 0 && len(ds) > limit {
		ds = ds[len(ds)-limit:]
	}
	return Status{
		DryRun: p.cfg.DryRun, TTFTMs: ms(p.cfg.TTFT), ITLMs: ms(p.cfg.ITL), Interval: p.cfg.Interval.String(),
		Predictor: p.cfg.Predictor, Pools: p.cfg.Pools, Replicas: p.Replicas(), Decisions: ds,
	}
}

// Handler serves the planner read-only as JSON: GET /v1/planner/decisions[?limit=N] (the
// status with the decisions; ?changes=1 keeps only those that changed or tried to change a
// pool). Mount it under /v1/planner/.
func (p *Planner) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/planner/decisions", func(w http.ResponseWriter, r *http.Request) {
		limit, _ := strconv.Atoi(r.URL.Query().Get("limit"))
		st := p.Status(0)
		if r.URL.Query().Get("changes") != "" {
			kept := st.Decisions[:0]
			for _, d := range st.Decisions {
				if d.From != d.To {
					kept = append(kept, d)
				}
			}
			st.Decisions = kept
		}
		if limit > 0 && len(st.Decisions) > limit {
			st.Decisions = st.Decisions[len(st.Decisions)-limit:]
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(st)
	})
	return mux
}
