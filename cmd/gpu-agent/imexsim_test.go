package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// imexProc is a stand-in IMEX daemon running as its own process (this test
// binary, as TestMain dispatches), with its log read line by line.
type imexProc struct {
	cmd   *exec.Cmd
	cfg   string
	lines chan string
}

func startIMEXProc(t *testing.T, ip string, port, cmdPort int, nodes string) *imexProc {
	t.Helper()
	dir := t.TempDir()
	nodesFile := filepath.Join(dir, "nodes.cfg")
	cfg := filepath.Join(dir, "imexd.cfg")
	if err := os.WriteFile(nodesFile, []byte(nodes), 0o644); err != nil {
		t.Fatal(err)
	}
	// The settings NVIDIA's compute domain daemon writes.
	conf := fmt.Sprintf("SERVER_PORT=%d\nBIND_INTERFACE_IP=%s\nIMEX_CMD_PORT=%d\nIMEX_CMD_BIND_INTERFACE_IP=%s\n"+
		"IMEX_NODE_CONFIG_FILE=%s\nIMEX_WAIT_FOR_QUORUM=RECOVERY\nIMEX_ENABLE_AUTH_ENCRYPTION=0\n", port, ip, cmdPort, ip, nodesFile)
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, imexSimCommand, "-c", cfg)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &imexProc{cmd: cmd, cfg: cfg, lines: make(chan string, 100)}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	return p
}

// waitLog waits for a log line containing want; the daemon logs every turn
// of its readiness, so this waits on the event itself.
func (p *imexProc) waitLog(t *testing.T, want string) {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				t.Fatalf("daemon exited before logging %q", want)
			}
			if strings.Contains(line, want) {
				return
			}
		case <-timeout:
			t.Fatalf("no %q in the daemon's log", want)
		}
	}
}

func (p *imexProc) ctl(t *testing.T, flag string) (int, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := runMain(context.Background(), []string{imexCtlSimCommand, "-c", p.cfg, flag}, &out, &errOut)
	return code, out.String() + errOut.String()
}

// Two stand-in daemons as processes: each READY once the other runs, with
// nvidia-imex-ctl's -q and -N; one rereads its node list on SIGUSR1.
func TestIMEXStandInProcesses(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmdPort := port + 1
	nodes := "127.0.0.1\n127.0.0.2\n"
	a := startIMEXProc(t, "127.0.0.1", port, cmdPort, nodes)
	a.waitLog(t, "listening")
	if code, out := a.ctl(t, "-q"); code != 1 || out != "UNAVAILABLE\n" {
		t.Errorf("-q alone: exit %d, %q", code, out)
	}
	b := startIMEXProc(t, "127.0.0.2", port, cmdPort, nodes)
	a.waitLog(t, "READY")
	b.waitLog(t, "READY")
	if code, out := a.ctl(t, "-q"); code != 0 || out != "READY\n" {
		t.Errorf("-q: exit %d, %q", code, out)
	}
	if code, out := b.ctl(t, "-N"); code != 0 || out != "Node #0 - 127.0.0.1 - CONNECTED\nNode #1 - 127.0.0.2 - SELF\n" {
		t.Errorf("-N: exit %d, %q", code, out)
	}
	// A third node joins a's list; SIGUSR1 makes a read it, and wait for it.
	cfg, err := readIMEXConfig(a.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg.NodeConfigFile, []byte(nodes+"127.0.0.3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	a.waitLog(t, "UNAVAILABLE")
	if code, _ := a.ctl(t, "-x"); code != 2 {
		t.Errorf("unknown flag: exit %d, want 2", code)
	}
}
