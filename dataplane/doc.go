// Package dataplane is kvrelay's edge proxy. Its packages frame HTTP/1.1 on gnet event loops
// (http1), parse OpenAI requests and observe responses (oai), decide each request in one
// place whoever carries it (decide: tokenize, hash prompts into block chains, route over a
// filter → scorer → picker chain, queue, account), and carry requests to pooled upstream
// engines (proxy) or leave a gateway to (epp). It never imports the control plane; routing
// state arrives through package xds.
package dataplane
