// Package dataplane is kvrelay's edge proxy. Its packages frame HTTP/1.1 on gnet event loops
// (http1), parse OpenAI requests and observe responses (oai), hash prompts into block chains,
// route over a filter → scorer → picker chain, and forward to pooled upstream engines. It
// never imports the control plane; routing state arrives through package xds.
package dataplane
