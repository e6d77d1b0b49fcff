package imex

import (
	"fmt"
	"hash/fnv"
)

// preferredChannel is the channel a domain asks for first on every node:
// derived from its UID alone, so that the nodes of one domain agree on it
// without talking (IMEX matches a channel across the domain's nodes by its
// number). Channel 0 is left out while there are others: NVIDIA's driver
// gives channel 0 to every domain, and a pod of such a deployment on the
// same fabric must not share one with ours.
func preferredChannel(domain string, channels int) int {
	if channels <= 1 {
		return 0
	}
	h := fnv.New32a()
	h.Write([]byte(domain))
	return 1 + int(h.Sum32()%uint32(channels-1))
}

// assignChannel picks the host channel of domain on this node: the one
// its claims already hold, else its preferred channel, else the next one
// up that no other domain holds here (wrapping, channel 0 last). held maps
// each channel some domain holds to that domain.
func assignChannel(domain string, channels int, held map[int]string) (int, error) {
	for ch, d := range held {
		if d == domain {
			return ch, nil
		}
	}
	if channels == 0 {
		return 0, fmt.Errorf("domain %s: the driver offers no IMEX channel (ImexChannelCount 0)", domain)
	}
	first := preferredChannel(domain, channels)
	for i := range channels {
		ch := (first-1+i)%max(channels-1, 1) + 1
		if channels == 1 || i == channels-1 {
			ch = 0
		}
		if _, taken := held[ch]; !taken {
			return ch, nil
		}
	}
	return 0, fmt.Errorf("domain %s: all %d IMEX channels of the node are held by other domains", domain, channels)
}

// serverPorts are the IMEX daemon's ports for a domain whose channel is
// ch: each domain's daemons listen on ports of their own, so that a
// daemon of one domain can never reach another's, even at an address the
// other used before (NVIDIA's #1447), and several domains' daemons share a
// node. The nodes of one domain agree on its channel, and so on its ports.
func serverPorts(ch int) (server, cmd int) {
	server = portBase + 2*(ch%portSlots)
	return server, server + 1
}

// portBase and portSlots: the daemons' ports are portBase to
// portBase+2*portSlots-1 (40000-63999).
const (
	portBase  = 40000
	portSlots = 12000
)
