package nixl

// The shared-memory backend's metadata entry: the host identity (agents with equal ones
// share a kernel) and the abstract Unix socket that hands out memory files, each as
// (u16 length, bytes).

func encodeSHMInfo(host, sock string) []byte {
	return appendStr16(appendStr16(nil, host), sock)
}

// parseSHMInfo decodes a peer's shared-memory backend info.
func parseSHMInfo(info []byte) (host, sock string, ok bool) {
	d := decoder{b: info}
	host = d.str16(mdMaxName)
	sock = d.str16(mdMaxName)
	return host, sock, d.err == nil && d.left() == 0 && host != "" && sock != ""
}
