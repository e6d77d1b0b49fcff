// Package imexsim is a stand-in for NVIDIA's IMEX daemon (nvidia-imex) and
// its control program (nvidia-imex-ctl) on simulated nodes, which have no
// NVLink fabric to export memory over. It reads the real config and node
// list files, forms a quorum with the daemons of the nodes the list names,
// answers the READY query and rereads the node list on SIGUSR1, so that
// what orchestrates IMEX daemons can be tested as it runs on GB200 racks.
package imexsim

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
)

// DefaultConfigPath and DefaultNodeConfigPath are where nvidia-imex looks
// without -c, and its default IMEX_NODE_CONFIG_FILE.
const (
	DefaultConfigPath     = "/etc/nvidia-imex/config.cfg"
	DefaultNodeConfigPath = "/etc/nvidia-imex/nodes_config.cfg"
)

// maxFileBytes bounds a config or node list: NVIDIA's template is a few KB,
// a node list at most some hundred lines.
const maxFileBytes = 1 << 20

// Quorum is IMEX_WAIT_FOR_QUORUM.
type Quorum string

// The quorum settings. The real daemon with RECOVERY waits only for nodes
// that imported memory before an unclean shutdown; the stand-in has no
// imports, and waits for every listed node whose name resolves (see
// Daemon), which is what a test of IMEX orchestration needs to see.
const (
	QuorumRecovery Quorum = "RECOVERY"
	QuorumNone     Quorum = "NONE"
)

// Config is what the stand-in reads of an IMEX config file. Keys it does
// not use (logging, timeouts, encryption) are accepted and kept in Other,
// as NVIDIA's daemon takes the whole of its template.
type Config struct {
	// ServerPort is SERVER_PORT (default 50000): where daemons reach
	// each other.
	ServerPort int
	// BindIP is BIND_INTERFACE_IP; "" means the node list entry that is
	// one of this host's addresses.
	BindIP string
	// NodeConfigFile is IMEX_NODE_CONFIG_FILE.
	NodeConfigFile string
	// CmdPort and CmdBindIP are IMEX_CMD_PORT (default 50005) and
	// IMEX_CMD_BIND_INTERFACE_IP (default 127.0.0.1), where
	// nvidia-imex-ctl asks; CmdEnabled is IMEX_CMD_ENABLED (default on).
	CmdPort    int
	CmdBindIP  string
	CmdEnabled bool
	// WaitForQuorum is IMEX_WAIT_FOR_QUORUM (default RECOVERY).
	WaitForQuorum Quorum
	// Other holds the other keys, as written.
	Other map[string]string
}

// ParseConfig reads an IMEX config file: KEY=VALUE lines, '#' comments
// and blank lines. A line of another shape, a key given twice or a value
// out of range is an error naming the line.
func ParseConfig(r io.Reader) (Config, error) {
	c := Config{ServerPort: 50000, NodeConfigFile: DefaultNodeConfigPath, CmdPort: 50005, CmdBindIP: "127.0.0.1",
		CmdEnabled: true, WaitForQuorum: QuorumRecovery, Other: map[string]string{}}
	seen := map[string]int{}
	err := eachLine(r, func(n int, line string) error {
		key, val, ok := strings.Cut(line, "=")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		if !ok || !validKey(key) {
			return fmt.Errorf("line %d: %q: want KEY=VALUE", n, line)
		}
		if first, dup := seen[key]; dup {
			return fmt.Errorf("line %d: %s given again (first on line %d)", n, key, first)
		}
		seen[key] = n
		var err error
		switch key {
		case "SERVER_PORT":
			c.ServerPort, err = port(val)
		case "BIND_INTERFACE_IP":
			c.BindIP, err = ip(val, true)
		case "IMEX_NODE_CONFIG_FILE":
			if val == "" {
				err = errors.New("want a file path")
			}
			c.NodeConfigFile = val
		case "IMEX_CMD_PORT":
			c.CmdPort, err = port(val)
		case "IMEX_CMD_BIND_INTERFACE_IP":
			c.CmdBindIP, err = ip(val, false)
		case "IMEX_CMD_ENABLED":
			c.CmdEnabled, err = flag01(val)
		case "IMEX_WAIT_FOR_QUORUM":
			c.WaitForQuorum = Quorum(val)
			if c.WaitForQuorum != QuorumRecovery && c.WaitForQuorum != QuorumNone {
				err = fmt.Errorf("want %s or %s", QuorumRecovery, QuorumNone)
			}
		default:
			c.Other[key] = val
		}
		if err != nil {
			return fmt.Errorf("line %d: %s=%q: %w", n, key, val, err)
		}
		return nil
	})
	return c, err
}

// eachLine calls f with every line that is not blank or a comment,
// trimmed, and its 1-based number.
func eachLine(r io.Reader, f func(n int, line string) error) error {
	sc := bufio.NewScanner(io.LimitReader(r, maxFileBytes+1))
	sc.Buffer(make([]byte, 4096), maxFileBytes+1)
	read := 0
	for n := 1; sc.Scan(); n++ {
		read += len(sc.Bytes()) + 1
		if read > maxFileBytes+1 {
			return fmt.Errorf("larger than %d bytes", maxFileBytes)
		}
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := f(n, line); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return fmt.Errorf("larger than %d bytes", maxFileBytes)
		}
		return err
	}
	return nil
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range k {
		if (c < 'A' || c > 'Z') && (c < '0' || c > '9') && c != '_' {
			return false
		}
	}
	return true
}

func port(v string) (int, error) {
	p, err := strconv.Atoi(v)
	if err != nil || p < 1 || p > 65535 {
		return 0, errors.New("want a TCP port, 1 to 65535")
	}
	return p, nil
}

func ip(v string, emptyOK bool) (string, error) {
	if v == "" && emptyOK {
		return "", nil
	}
	if net.ParseIP(v) == nil {
		return "", errors.New("want an IPv4 or IPv6 address")
	}
	return v, nil
}

func flag01(v string) (bool, error) {
	switch v {
	case "0":
		return false, nil
	case "1":
		return true, nil
	}
	return false, errors.New("want 0 or 1")
}

// Nodes is an IMEX node list: the addresses or names of the domain's
// nodes, one a line, in the file's order.
type Nodes []string

// maxNodes bounds a node list: an NVLink domain has at most some hundred
// nodes (NVL576), NVIDIA's driver lists up to its max nodes per domain.
const maxNodes = 1024

// ParseNodes reads a node list file: one IP address or host name a line,
// '#' comments and blank lines skipped. A name listed twice, or one that
// is neither an address nor a host name, is an error naming the line.
func ParseNodes(r io.Reader) (Nodes, error) {
	var nodes Nodes
	seen := map[string]int{}
	err := eachLine(r, func(n int, line string) error {
		if !hostOrIP(line) {
			return fmt.Errorf("line %d: %q: want an IP address or a host name", n, line)
		}
		if first, dup := seen[line]; dup {
			return fmt.Errorf("line %d: %s listed again (first on line %d)", n, line, first)
		}
		if len(nodes) == maxNodes {
			return fmt.Errorf("line %d: more than %d nodes", n, maxNodes)
		}
		seen[line] = n
		nodes = append(nodes, line)
		return nil
	})
	return nodes, err
}

func hostOrIP(s string) bool {
	if net.ParseIP(s) != nil {
		return true
	}
	if len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			if (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') && c != '-' {
				return false
			}
		}
	}
	return true
}

// Key identifies a node list, as the real daemon keys its peers' maps:
// daemons whose lists differ are not of one domain, and refuse each other.
func (n Nodes) Key() string {
	h := sha256.New()
	for _, node := range n {
		h.Write([]byte(node))
		h.Write([]byte{'\n'})
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}
