package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// fakeKubelet is the two kubelet services an agent talks to on its own:
// registration on <device-plugin-dir>/kubelet.sock, and pod-resources List
// on its --pod-resources-socket, which lists no pods (the bench's
// allocations are never started as containers).
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	podresourcesv1.UnimplementedPodResourcesListerServer

	mu         sync.Mutex
	registered map[string]string // resource name → the endpoint it registered
	changed    chan struct{}     // closed and replaced on each registration
	lists      atomic.Int64

	servers []*grpc.Server
}

// startFakeKubelet serves registration on regSocket and pod-resources on
// prSocket until stop.
func startFakeKubelet(regSocket, prSocket string) (*fakeKubelet, error) {
	k := &fakeKubelet{registered: map[string]string{}, changed: make(chan struct{})}
	for _, s := range []struct {
		path     string
		register func(*grpc.Server)
	}{
		{regSocket, func(srv *grpc.Server) { pluginapi.RegisterRegistrationServer(srv, k) }},
		{prSocket, func(srv *grpc.Server) { podresourcesv1.RegisterPodResourcesListerServer(srv, k) }},
	} {
		ln, err := net.Listen("unix", s.path)
		if err != nil {
			k.stop()
			return nil, err
		}
		srv := grpc.NewServer()
		s.register(srv)
		k.servers = append(k.servers, srv)
		go func() { _ = srv.Serve(ln) }()
	}
	return k, nil
}

func (k *fakeKubelet) stop() {
	for _, srv := range k.servers {
		srv.Stop()
	}
}

// Register implements [pluginapi.RegistrationServer.Register].
func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	if r.GetVersion() != pluginapi.Version {
		return nil, fmt.Errorf("device plugin API version %q, want %q", r.GetVersion(), pluginapi.Version)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.registered[r.GetResourceName()] = r.GetEndpoint()
	close(k.changed)
	k.changed = make(chan struct{})
	return &pluginapi.Empty{}, nil
}

// endpoint waits until resource is registered and returns its endpoint (a
// socket name in the device plugin directory).
func (k *fakeKubelet) endpoint(ctx context.Context, resource string) (string, error) {
	for {
		k.mu.Lock()
		ep, ok := k.registered[resource]
		changed := k.changed
		var have []string
		for r := range k.registered {
			have = append(have, r)
		}
		k.mu.Unlock()
		if ok {
			return ep, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return "", fmt.Errorf("%s not registered (registered: [%s]): %w", resource, strings.Join(have, " "), ctx.Err())
		}
	}
}

// List implements [podresourcesv1.PodResourcesListerServer.List]: no pods.
func (k *fakeKubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	k.lists.Add(1)
	return &podresourcesv1.ListPodResourcesResponse{}, nil
}
