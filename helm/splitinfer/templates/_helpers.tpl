{{/*
Names. Kubernetes object names are DNS labels: at most 63 characters.
*/}}
{{- define "splitinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitinfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: name and instance identify the release; component tells the
gateway, planner, Ray and edge-agent pods of one release apart. Without it the
gateway Service would also select planner pods, and each Deployment's
ReplicaSet would count the other's pods as its own. Selectors are immutable,
so nothing that can change between releases (version, chart) goes in here.
Usage: include "splitinfer.selectorLabels" (dict "ctx" $ "component" "gateway")
*/}}
{{- define "splitinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitinfer.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/*
Full label set for metadata. Usage as for selectorLabels.
*/}}
{{- define "splitinfer.labels" -}}
{{ include "splitinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: {{ .ctx.Values.partOf }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "splitinfer.chart" .ctx }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "splitinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "splitinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "splitinfer.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "splitinfer.gpuImage" -}}
{{- $img := .Values.rayCluster.gpuWorkers.image }}
{{- if or $img.repository $img.tag }}
{{- printf "%s:%s" (default .Values.image.repository $img.repository) (default (default .Chart.AppVersion .Values.image.tag) $img.tag) }}
{{- else }}
{{- include "splitinfer.image" . }}
{{- end }}
{{- end }}

{{- define "splitinfer.rayClusterName" -}}
{{- default (printf "%s-ray" (include "splitinfer.fullname" .)) .Values.rayCluster.name | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/*
Ray client address for the gateway: KubeRay names the head Service
<raycluster>-head-svc.
*/}}
{{- define "splitinfer.rayAddress" -}}
{{- if .Values.rayCluster.enabled }}
{{- printf "%s-head-svc.%s.svc:%d" (include "splitinfer.rayClusterName" .) .Release.Namespace (int .Values.rayCluster.head.clientPort) }}
{{- else }}
{{- required "rayCluster.address is required when rayCluster.enabled is false: set it to an existing Ray cluster's client endpoint, e.g. my-ray-head-svc.ray.svc:10001" .Values.rayCluster.address }}
{{- end }}
{{- end }}

{{- define "splitinfer.modelsClaimName" -}}
{{- default (printf "%s-models" (include "splitinfer.fullname" .)) .Values.models.existingClaim }}
{{- end }}

{{- define "splitinfer.tokensSecretName" -}}
{{- default (printf "%s-tokens" (include "splitinfer.fullname" .)) .Values.auth.tokens.existingSecret }}
{{- end }}

{{- define "splitinfer.registryConfigMapName" -}}
{{- printf "%s-registry" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitinfer.gatewayServiceName" -}}
{{- printf "%s-gateway" (include "splitinfer.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Security contexts of the restricted Pod Security Standard.
*/}}
{{- define "splitinfer.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "splitinfer.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext }}
{{- end }}

{{/*
Model repository volume (a PVC, an existing claim, or an emptyDir for demos).
*/}}
{{- define "splitinfer.modelsVolume" -}}
- name: models
{{- if or .Values.models.existingClaim .Values.models.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "splitinfer.modelsClaimName" . }}
    readOnly: {{ .Values.models.readOnly }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "splitinfer.modelsMount" -}}
- name: models
  mountPath: /models
  readOnly: {{ .Values.models.readOnly }}
{{- end }}

{{- define "splitinfer.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "splitinfer.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
Environment shared by every splitinfer container: HOME on the writable /tmp
because the root filesystem is read-only (Ray, matplotlib and Python caches
write under HOME).
*/}}
{{- define "splitinfer.commonEnv" -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: SPLITINFER_RELEASE
  value: {{ .Release.Name | quote }}
- name: SPLITINFER_REGISTRY_CONFIGMAP
  value: {{ include "splitinfer.registryConfigMapName" . | quote }}
{{- end }}

{{/*
Preferred anti-affinity that spreads one component's replicas over nodes.
*/}}
{{- define "splitinfer.spreadAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "splitinfer.selectorLabels" . | nindent 12 }}
{{- end }}

{{/*
failureThreshold that lets a startupProbe wait timeoutSeconds in total.
Usage: include "splitinfer.startupFailureThreshold" (list timeout period)
*/}}
{{- define "splitinfer.startupFailureThreshold" -}}
{{- $timeout := int (index . 0) }}
{{- $period := int (index . 1) }}
{{- max 1 (div (add $timeout $period -1) $period) }}
{{- end }}

{{/*
The gateway readiness probe kind after resolving "auto": kubelet's gRPC probe
speaks plaintext only, so a TLS gateway is probed on its HTTP /readyz.
*/}}
{{- define "splitinfer.gatewayReadinessType" -}}
{{- $t := .Values.gateway.probes.readinessType }}
{{- if eq $t "auto" }}
{{- ternary "http" "grpc" .Values.tls.enabled }}
{{- else if and (eq $t "grpc") .Values.tls.enabled }}
{{- fail "gateway.probes.readinessType=grpc cannot work with tls.enabled=true: kubelet's gRPC probe does not speak TLS. Use readinessType=auto or http." }}
{{- else }}
{{- $t }}
{{- end }}
{{- end }}

{{/*
Ray pods: /tmp for Ray's session directory, /dev/shm for the object store,
/models for the segments the workers load.
*/}}
{{- define "splitinfer.rayEnv" -}}
{{ include "splitinfer.commonEnv" . }}
# No usage reports to the Ray project: clusters are often air-gapped.
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- end }}

{{- define "splitinfer.rayMounts" -}}
{{ include "splitinfer.modelsMount" . }}
{{ include "splitinfer.tmpMount" . }}
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{- define "splitinfer.rayVolumes" -}}
{{ include "splitinfer.modelsVolume" . }}
{{ include "splitinfer.tmpVolume" . }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.rayCluster.shmSizeLimit }}
{{- end }}
