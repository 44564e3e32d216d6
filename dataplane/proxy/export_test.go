package proxy

// The bodies of the two legs of a disaggregated request, for tests against vLLM's fixtures.
var (
	PrefillLegBody = prefillBody
	PrefillParams  = prefillParams
	DecodeLegBody  = decodeLegBody
)
