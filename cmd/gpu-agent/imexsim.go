package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/gpu-agent/gpu-agent/imexsim"
)

// The hidden subcommands that stand in for nvidia-imex and nvidia-imex-ctl
// on simulated nodes, taking the real programs' options.
const (
	imexSimCommand    = "imex-sim"
	imexCtlSimCommand = "imex-ctl-sim"
)

// readIMEXConfig reads the IMEX config file at path.
func readIMEXConfig(path string) (imexsim.Config, error) {
	f, err := os.Open(path)
	if err != nil {
		return imexsim.Config{}, fmt.Errorf("IMEX config: %w", err)
	}
	defer f.Close()
	c, err := imexsim.ParseConfig(f)
	if err != nil {
		return c, fmt.Errorf("IMEX config %s: %w", path, err)
	}
	return c, nil
}

// cmdIMEXSim runs `gpu-agent imex-sim [-c FILE]`: the stand-in IMEX daemon,
// in the foreground whatever DAEMONIZE says (a supervisor runs it), until
// SIGTERM or ctx ends; SIGUSR1 rereads the node list, as it makes
// nvidia-imex resolve its peers again.
func cmdIMEXSim(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet(imexSimCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("c", imexsim.DefaultConfigPath, "the IMEX config file")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	// Before the node list is first read: a SIGUSR1 sent while it is
	// read waits here and makes it read again, rather than being lost.
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	cfg, err := readIMEXConfig(*cfgPath)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	d, err := imexsim.New(cfg, imexsim.Options{Logger: log})
	if err != nil {
		return err
	}
	reload := make(chan struct{})
	go func() {
		for range usr1 {
			select {
			case reload <- struct{}{}:
			case <-ctx.Done():
				return
			}
		}
	}()
	return d.Run(ctx, reload)
}

// cmdIMEXCtlSim runs `gpu-agent imex-ctl-sim [-c FILE] -q|-N`: -q prints
// READY or UNAVAILABLE (and exits 1 when not ready), -N the status of each
// node of the daemon's list.
func cmdIMEXCtlSim(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet(imexCtlSimCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("c", imexsim.DefaultConfigPath, "the IMEX config file (where the daemon takes commands)")
	q := fs.Bool("q", false, "print READY once the daemon is in quorum")
	nodes := fs.Bool("N", false, "print each node's status")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if *q == *nodes || fs.NArg() > 0 {
		return usageError{"want -q or -N"}
	}
	cfg, err := readIMEXConfig(*cfgPath)
	if err != nil {
		return err
	}
	command := "QUERY"
	if *nodes {
		command = "NODES"
	}
	out, err := imexsim.Ask(ctx, cfg, command)
	if err != nil {
		return err
	}
	if _, err := io.WriteString(stdout, out); err != nil {
		return err
	}
	if *q && out != "READY\n" {
		return errNotReady
	}
	return nil
}

// errNotReady makes imex-ctl-sim -q exit 1 without a message: its answer
// is on stdout already.
var errNotReady = silentError{}

type silentError struct{}

func (silentError) Error() string { return "" }
