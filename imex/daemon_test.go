package imex

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// The supervisor runs one daemon per domain (a shell stand-in that counts
// SIGUSR1s and answers READY once it has one), writes the domain's config
// with its own ports and node list, signals it when the node list changes,
// adopts it after a restart, and stops it when the domain is no longer
// wanted.
func TestSupervisor(t *testing.T) {
	dir := t.TempDir()
	daemon := `trap 'echo x >> "$(dirname "$2")/usr1"' USR1; while :; do sleep 0.05; done`
	ctl := `if [ -s "$(dirname "$2")/usr1" ]; then echo READY; else echo UNAVAILABLE; exit 1; fi`
	opts := SupervisorOptions{Binary: "/bin/sh", Args: []string{"-c", daemon, "imex"}, CtlBinary: "/bin/sh", CtlArgs: []string{"-c", ctl, "ctl"}, Dir: dir}
	s := NewSupervisor(opts)
	ctx := context.Background()
	spec := DaemonSpec{Domain: "cd-1", Name: "team/job", BindIP: "10.0.0.1", Nodes: []string{"10.0.0.1"}, ServerPort: 40002, CmdPort: 40003}
	s.Set([]DaemonSpec{spec})
	s.reconcile(ctx)
	st := s.State("cd-1")
	if st.PID == 0 || st.Ready {
		t.Fatalf("state %+v: want a running daemon, not ready", st)
	}
	cfg, err := os.ReadFile(filepath.Join(dir, "cd-1", "imexd.cfg"))
	if err != nil || !strings.Contains(string(cfg), "SERVER_PORT=40002\n") || !strings.Contains(string(cfg), "IMEX_CMD_PORT=40003\n") ||
		!strings.Contains(string(cfg), "BIND_INTERFACE_IP=10.0.0.1\n") || !strings.Contains(string(cfg), "IMEX_NODE_CONFIG_FILE="+filepath.Join(dir, "cd-1", "nodes.cfg")) {
		t.Fatalf("config %s %v", cfg, err)
	}
	// A new node: the list is rewritten and the daemon told.
	spec.Nodes = []string{"10.0.0.1", "10.0.0.2"}
	s.Set([]DaemonSpec{spec})
	testwait.For(t, "the daemon ready after SIGUSR1", func() bool { s.reconcile(ctx); return s.State("cd-1").Ready })
	if b, _ := os.ReadFile(filepath.Join(dir, "cd-1", "nodes.cfg")); string(b) != "10.0.0.1\n10.0.0.2\n" {
		t.Errorf("node list %q", b)
	}
	pid := s.State("cd-1").PID

	// A new supervisor (the agent restarted) adopts it.
	s2 := NewSupervisor(opts)
	s2.Set([]DaemonSpec{spec})
	s2.reconcile(ctx)
	if st := s2.State("cd-1"); st.PID != pid || !st.Ready {
		t.Fatalf("after restart %+v, want pid %d adopted and ready", st, pid)
	}
	s2.StopAll()
	if syscall.Kill(pid, 0) == nil {
		// Our child until reaped by the first supervisor's goroutine.
		testwait.For(t, "the daemon gone", func() bool { return syscall.Kill(pid, 0) != nil })
	}
	if _, err := os.Stat(filepath.Join(dir, "cd-1")); !os.IsNotExist(err) {
		t.Errorf("domain folder left: %v", err)
	}
}

// A node list that changes while the daemon is still starting (it has not
// answered a query yet) is told to it once it answers: a SIGUSR1 sent
// before its handler is in place would end it (a shell's default) or be
// lost. The daemon here traps SIGUSR1 only after a pause, and answers
// queries only once it has.
func TestSupervisorReloadAfterStartup(t *testing.T) {
	dir := t.TempDir()
	daemon := `sleep 0.5; trap 'echo x >> "$(dirname "$2")/usr1"' USR1; : > "$(dirname "$2")/up"; while :; do sleep 0.05; done`
	ctl := `d="$(dirname "$2")"; [ -e "$d/up" ] || exit 1; if [ -s "$d/usr1" ]; then echo READY; else echo UNAVAILABLE; exit 1; fi`
	s := NewSupervisor(SupervisorOptions{Binary: "/bin/sh", Args: []string{"-c", daemon, "imex"}, CtlBinary: "/bin/sh", CtlArgs: []string{"-c", ctl, "ctl"}, Dir: dir})
	defer s.StopAll()
	ctx := context.Background()
	spec := DaemonSpec{Domain: "cd-1", Name: "team/job", BindIP: "10.0.0.1", Nodes: []string{"10.0.0.1"}, ServerPort: 40002, CmdPort: 40003}
	s.Set([]DaemonSpec{spec})
	s.reconcile(ctx)
	pid := s.State("cd-1").PID
	if pid == 0 {
		t.Fatalf("state %+v: want a running daemon", s.State("cd-1"))
	}
	spec.Nodes = []string{"10.0.0.1", "10.0.0.2"}
	s.Set([]DaemonSpec{spec})
	s.reconcile(ctx) // still starting: not told yet
	if st := s.State("cd-1"); st.Ready || st.PID != pid {
		t.Fatalf("state %+v while starting: want pid %d, not ready", st, pid)
	}
	testwait.For(t, "the daemon ready after the deferred SIGUSR1", func() bool { s.reconcile(ctx); return s.State("cd-1").Ready })
	if st := s.State("cd-1"); st.PID != pid || st.Failures != 0 {
		t.Errorf("state %+v: want the first daemon (pid %d) told, never restarted", st, pid)
	}
}

// The command port is local on a real node; with CmdOnBindIP (several sim
// nodes on one host, each at a loopback address of its own) it is on the
// node's own address, so two nodes' daemons of one domain do not collide.
func TestConfigCommandAddress(t *testing.T) {
	spec := DaemonSpec{Domain: "cd-1", Name: "team/job", BindIP: "127.0.1.2", ServerPort: 40002, CmdPort: 40003}
	for _, tc := range []struct {
		name        string
		cmdOnBindIP bool
		spec        DaemonSpec
		want        string
	}{
		{"real node", false, spec, "IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\n"},
		{"sim node", true, spec, "IMEX_CMD_BIND_INTERFACE_IP=127.0.1.2\n"},
		{"sim node without an address", true, DaemonSpec{Domain: "cd-1", CmdPort: 40003}, "IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSupervisor(SupervisorOptions{Dir: t.TempDir(), CmdOnBindIP: tc.cmdOnBindIP})
			cfg := string(configText(tc.spec, "/nodes.cfg", s.cmdIP(tc.spec)))
			if !strings.Contains(cfg, tc.want) || strings.Count(cfg, "IMEX_CMD_BIND_INTERFACE_IP=") != 1 {
				t.Errorf("config:\n%s\nwant one line %q", cfg, tc.want)
			}
		})
	}
}
